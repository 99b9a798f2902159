"""What an update rule, a decay and a feature map put into the chunked kernels and the token loop (the
recurrent form), and a softmax mask and score bias into the softmax kernels: one small object each, which
the planner picks for a spec (planner.kernel_spec: KernelSpec.rule_hook, decay_hook, feature_hook,
mask_hook, bias_hook) and the templates call in place of branching on the rule, the decay, the map, the
mask or the bias (DESIGN.md §5's hooks).

Each method returns a Triton fragment, an expression or lines of code as the generated kernels
spell them, in the names the templates define: b_gam, b_gam_rest [BT] (scalar decay) or
[BT, BF] (vector) the per-token decays Γ_t and Γ_C/Γ_t, b_gam_C Γ_C (a scalar, or [BF]), b_G the
cumulative log decays, m_strict / m_strict_t the pairs s < t in [t, s] and [s, t], m_t / m_tf the
chunk's tokens, o_tok their rows; in the token loop b_a a token's decay factor, i_tok its row, i_part
the value block's first partial row. A fragment of a rule or decay that has none is the empty string
(which the templates' `piece` filter renders as no line). What needs the feature map's Jinja macros
too stays a macro of the templates (macros.jinja, the rule's folder).
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar


@dataclasses.dataclass(frozen=True)
class NoDecay:
    """No decay: every decay factor is 1 and there is no decay gradient."""

    kind: str = "none"

    @property
    def decayed(self) -> bool:
        return self.kind != "none"

    @property
    def pair_macros(self) -> str:
        """The template of the pair sums with this decay (templates/pairs/: the UT step's ut_block_decays and
        ut_block_pair, the backward's scores_t, key_pairs, pairs_rows and pairs_cols), which the chunked
        templates import as `pairs`."""
        return "pairs/none.jinja"

    @property
    def grad_macros(self) -> str:
        """The template of the decay gradient's terms in the backward's steps 4a, 4b and 5 (templates/decay_grads/:
        query_terms, output_terms, transform_terms), which the backward imports as `decay_grads`."""
        return "decay_grads/none.jinja"

    @property
    def walk_grad_macros(self) -> str:
        """The template of the recurrent backward's decay gradient (templates/decay_grads/walk_*.jinja: walk_start,
        walk_tangent, walk_query_term, walk_end, finish_start), which it imports as `walk_grads`: none; a
        constant decay's by forward mode (walk_constant); a per-token decay's from the last token back (walk_token)."""
        return "decay_grads/walk_" + {"none": "none", "constant": "constant"}.get(self.kind, "token") + ".jinja"

    @property
    def token_dg(self) -> bool:
        """Whether the decay gradient is per token (scalar, vector); a constant decay's is one sum."""
        return self.kind in ("scalar", "vector")

    # The chunked forward's host code: what its output pass reads of the decay (vector decay: Γ_C, whose
    # span picks each chunk's kernel, and a second kernel for the chunks by 16-token blocks) and the
    # buffer of the state passes' segment decays D.
    output_pointers: ClassVar[str] = ""             # the output kernels' Γ_C argument
    output_blocks_kernel: ClassVar[str] = ""        # the second output kernel, in CHUNKED_OUTPUT_KERNELS

    @property
    def released_before_output(self) -> str:
        """ChunkedStates' Γ_C freed before the output pass, where that pass does not read it."""
        return "" if self.output_pointers else ", gc=None"

    @property
    def segment_transition_buffer(self) -> str:
        """hd, the segments' decays D [N, G - 1, H, F] (None without a decay)."""
        return "torch.empty(N, G - 1, H, F, **f32) if G > 1 else None" if self.decayed else "None"

    def rows_times(self, x: str, gam: str) -> str:
        """x [BT, BF] (rows t) times the per-token factor gam."""
        return x

    def cols_times(self, x: str, gam: str) -> str:
        """x [BF, BT] (columns t) times the per-token factor gam."""
        return x

    def state_times(self, x: str) -> str:
        """A state block x [BF, BV] times Γ_C."""
        return x

    def load_chunk_decay(self, i_slot: str, name: str = "b_gam_C") -> str:
        """name (b_gam_C), Γ_C of chunk slot i_slot as the prepare step stored it."""
        return ""

    def zero_chunk_decay(self, name: str) -> str:
        """name, a Γ_C of zeros (the value of a load that did not run)."""
        return ""

    def first_chunk_decay_ahead(self, i_slot: str, any_chunk: str) -> str:
        """Before a loop over chunks that loads each chunk's Γ_C an iteration ahead (next_chunk_decay):
        b_gam_C_next, Γ_C of its first chunk, slot i_slot, loaded where any_chunk holds (zeros else)."""
        if not self.decayed:
            return ""
        return (f"{self.zero_chunk_decay('b_gam_C_next')}\nif {any_chunk}:\n"
                f"    {self.load_chunk_decay(i_slot, 'b_gam_C_next')}")

    def next_chunk_decay(self, i_slot: str) -> str:
        """At the top of that loop: b_gam_C, this chunk's Γ_C (loaded an iteration before), and
        b_gam_C_next, that of the next chunk, slot i_slot."""
        if not self.decayed:
            return ""
        return ("b_gam_C = b_gam_C_next\n# (the last chunk loads its own again: a slot of this sequence)\n"
                f"{self.load_chunk_decay(i_slot, 'b_gam_C_next')}")

    def output_scores(self) -> str:
        """The output pass's (not vector decay's) P [BT, BT], the decayed causal scores of the queries b_q and the
        keys b_kt [BF, BT] on m_causal, and b_qg, the queries that read the chunk-start state."""
        return "b_P = tl.where(m_causal, chunked_dot(b_q, b_kt, DOT_PRECISION), 0.0)\nb_qg = b_q"

    def pair_decays(self) -> str:
        """The pairs' decay ratios Γ_t/Γ_s (s < t) as factors of whole [BT, BT] tiles: D in [t, s], D^T in [s, t]."""
        return ""

    def chunk_program_decay(self) -> str:
        """b_gc, a constant decay's log decay of head i_h (G_DTYPE, floored), loaded once per program of a chunked
        step: macros.chunk_decays spreads it over a chunk's tokens."""
        return "b_gc = floor_log_decay(tl.load(g + i_h).to(G_DTYPE))" if self.kind == "constant" else ""

    def column_times(self, x: str) -> str:
        """x [BF] (the normalizer column z, or its gradient) times Γ_C."""
        return f"{x} * b_gam_C" if self.decayed else x

    # The state passes' segments (kernel_lib.chunked_state_segments) with the additive rule (rule.segments): a
    # segment's end state is D S + E of its start state S, D [BF] the product of its chunks' Γ_C (1 without a
    # decay), E its end state from zeros; segment o_e's D and E stored by the first launch (ENDS), read by the
    # second. (The delta rule's transition is a matrix: TransitionSegments.)
    matrix: ClassVar[bool] = False      # whether the transition is a [F, F] matrix (a diagonal here: E starts from zeros)

    def segment_carry(self, x: str, d: str, e: str) -> str:
        """x [BF, BV] <- D x + e, D segment o_e's decay from d (b_dj, for segment_carry_column too)."""
        if not self.decayed:
            return f"{x} += {e}"
        return f"b_dj = tl.load({d} + o_e * F + o_f, mask=m_f, other=0.0)\n{x} = {x} * b_dj[:, None] + {e}"

    def segment_carry_column(self, x: str, e: str) -> str:
        """x [BF] (the normalizer column or its gradient) <- D x + e."""
        return f"{x} = {x} * b_dj + {e}" if self.decayed else f"{x} = {x} + {e}"

    def segment_transition_start(self) -> str:
        """ENDS: b_dseg [BF], the segment's D so far (before its first chunk)."""
        return "b_dseg = tl.full([BF], 1.0, tl.float32)" if self.decayed else ""

    def segment_transition_step(self) -> str:
        """ENDS: b_dseg after a chunk (Γ_C in b_gam_C)."""
        return "if ENDS:\n    b_dseg = b_dseg * b_gam_C" if self.decayed else ""

    def segment_transition_store(self, d: str, x: str) -> str:
        """ENDS: the segment's D into d, row o_e (by value block 0; x, the state, not read)."""
        return f"tl.store({d} + o_e * F + o_f, b_dseg, mask=m_f)" if self.decayed else ""

    # The decay gradient's chunk term sum_v h_c ⊙ dS [BF] (b_dgc): summed in step 4a's loop over value blocks,
    # where h_c is loaded anyway (b_hct [BV, BF], offsets o_hc), stored into dgc for step 4b, which loads it.
    def chunk_term_start(self, normalized: bool) -> str:
        """b_dgc before the loop: zeros, or with the sum normalizer z_c ⊙ dz, the normalizer column's share."""
        if not self.decayed:
            return ""
        if normalized:
            return ("# z_c ⊙ dz, the chunk term's share of the normalizer column\n"
                    "b_dgc = b_zc * tl.load(dsz + (i_s.to(tl.int64) * H + i_h) * F + o_f, mask=m_f, other=0.0)")
        return "b_dgc = tl.zeros([BF], dtype=tl.float32)"

    def chunk_term_block(self) -> str:
        """The value block's share of b_dgc."""
        if not self.decayed:
            return ""
        return ("# [BV, BF] dS transposed by the load, as h_c\n"
                "b_dst = tl.load(ds + o_hc + o_f[None, :] * V + o_v[:, None], mask=m_v[:, None] & m_f[None, :], other=0.0)\n"
                + self.chunk_term_sum())

    def chunk_term_sum(self) -> str:
        """The value block's share of b_dgc from its tiles of h_c and dS as loaded (b_hct, b_dst [BV, BF])."""
        if not self.decayed:
            return ""
        return "b_dgc += tl.sum(b_hct.to(tl.float32) * b_dst.to(tl.float32), 0)"

    def chunk_term_store(self) -> str:
        """b_dgc into dgc, chunk slot i_s."""
        if not self.decayed:
            return ""
        return ("# [BF] the chunk term's sum_v h_c ⊙ dS, step 4b's\n"
                "tl.store(dgc + (i_s.to(tl.int64) * H + i_h) * F + o_f, b_dgc, mask=m_f)")

    def chunk_term_load(self) -> str:
        """Step 4b: b_dgc, as step 4a stored it."""
        if not self.decayed:
            return ""
        return ("# [BF] the chunk term's sum_v h_c ⊙ dS (step 4a's)\n"
                "b_dgc = tl.load(dgc + (i_s.to(tl.int64) * H + i_h) * F + o_f, mask=m_f, other=0.0)")

    def chunk_decay_buffer(self) -> str:
        """The host's gc, Γ_C per chunk slot (float32), which the prepare step writes."""
        return "gc = None"

    def store_state_keys(self) -> str:
        """The prepare step's keys of the state update from b_k [BT, BF] (into kr), and Γ_C of slot i_s (into gc)."""
        return ("# [BT, BF] the keys of the state update\n"
                "tl.store(kr + o_tok[:, None] * F + o_f[None, :], b_k.to(kr.dtype.element_ty), mask=m_tf)")

    def beta_keys(self) -> str:
        """The delta rule's diag(β) (K ⊙ Γ) [BT, BF] (b_y), from b_k and b_beta."""
        return "# [BT, BF] diag(β) K\nb_y = b_k * b_beta[:, None]"

    def token_terms(self, x: str) -> str:
        """The decay gradient's per-token pieces of x [BT, BF] (G_DTYPE)."""
        return ""

    def chunk_term(self) -> str:
        """The decay gradient's chunk term Γ_C sum_v h_c ⊙ dS, from b_dgc [BF] = sum_v h_c ⊙ dS (G_DTYPE)."""
        return ""

    def dg_rows(self) -> str:
        """The rows of the chunk's tokens in the decay gradient."""
        return ""

    def dg_mask(self) -> str:
        """Their mask."""
        return ""

    # The token loop (the recurrent form's forward and backward): b_a, a token's decay factor a_t
    # (a number, or a column [BF, 1] for a vector decay), S'_t = a_t S_{t-1}.
    def program_decay(self) -> str:
        """b_a where it is one per head (constant), loaded once before the loop."""
        return ""

    def token_decay(self) -> str:
        """b_a of token i_tok where it differs by token."""
        return ""

    def apply_decay(self, x: str, note: str = "") -> str:
        """x [BF, BV] (a state block or its gradient) times b_a, in place, after the comment note (b_a
        broadcasts over the columns, a number or a [BF, 1] column alike)."""
        if not self.decayed:
            return ""
        return (f"# {note}\n" if note else "") + f"{x} = {x} * b_a"

    def apply_decay_column(self, x: str) -> str:
        """x [BF] (the normalizer column or its gradient) times b_a, in place."""
        return ""

    def walk_dg_term(self, x: str, op: str = "") -> str:
        """The recurrent backward's per-token term x of the decay gradient (an elementwise product [BF]; a
        scalar decay's is its sum) in this value block's partial row of token i_tok (dgc): stored (op ""),
        or added to or taken from what the row holds (op "+" or "-"). A constant decay's gradient is
        not per token (forward mode: the template's tangent)."""
        return ""

    def finish_dg_partial(self) -> str:
        """The last pass: block i_b's partial row i_row of the per-token terms, added to b_dg."""
        return ""

    def finish_dg_store(self) -> str:
        """The last pass: dg_t (b_dg) of token i_tok."""
        return ""

    def walk_dg_buffers(self) -> str:
        """The launcher's buffers of the decay gradient's partials: dgc per token, dgb per sequence."""
        return "dgc = dgb = None"

    def walk_dg_output(self) -> str:
        """The launcher's dg, which the last pass writes."""
        return "dg = None"

    def walk_dg_result(self) -> str:
        """dg as the op returns it, after the last pass."""
        return ""


@dataclasses.dataclass(frozen=True)
class ScalarDecay(NoDecay):
    """A decay per token and head (scalar; constant: per head), Γ_t [BT]: factors broadcast over the
    features, the decay gradient [B, T, H] (a constant decay's one sum per head)."""

    kind: str = "scalar"

    @property
    def pair_macros(self) -> str:
        return "pairs/scalar.jinja"

    @property
    def grad_macros(self) -> str:
        # by token; a constant decay's one sum per head, chunk by chunk
        return "decay_grads/token.jinja" if self.kind == "scalar" else "decay_grads/constant.jinja"

    def rows_times(self, x: str, gam: str) -> str:
        return f"{x} * {gam}[:, None]"

    def cols_times(self, x: str, gam: str) -> str:
        return f"{x} * {gam}[None, :]"

    def state_times(self, x: str) -> str:
        return f"{x} * b_gam_C"

    def load_chunk_decay(self, i_slot: str, name: str = "b_gam_C") -> str:
        return f"{name} = tl.load(gc + {i_slot} * H + i_h)"

    def zero_chunk_decay(self, name: str) -> str:
        return f"{name} = 0.0"

    def chunk_decay_buffer(self) -> str:
        return "gc = torch.empty(n_slots, H, **f32)"

    def store_state_keys(self) -> str:
        return ("# [BT, BF] the keys of the state update, K ⊙ Γ_C/Γ, and Γ_C (slot i_s)\n"
                "tl.store(kr + o_tok[:, None] * F + o_f[None, :], (b_k * b_gam_rest[:, None]).to(kr.dtype.element_ty), mask=m_tf)\n"
                "tl.store(gc + i_s.to(tl.int64) * H + i_h, b_gam_C)")

    def beta_keys(self) -> str:
        return "# [BT, BF] diag(β) (K ⊙ Γ)\nb_y = b_k * (b_beta * b_gam)[:, None]"

    def output_scores(self) -> str:
        return ("b_P = chunked_dot(b_q, b_kt, DOT_PRECISION) * "
                'tl.exp(tl.where(m_causal, (b_G[:, None] - b_G[None, :]).to(tl.float32), float("-inf")))\n'
                "# [BT, BF] the queries read the chunk-start state through Γ_t\nb_qg = b_q * b_gam[:, None]")

    def pair_decays(self) -> str:
        return ("# [BT, BT] Γ_t/Γ_s on s < t: D [t, s], D^T [s, t]\n"
                'b_D = tl.exp(tl.where(m_strict, (b_G[:, None] - b_G[None, :]).to(tl.float32), float("-inf")))\n'
                'b_Dt = tl.exp(tl.where(m_strict_t, (b_G[None, :] - b_G[:, None]).to(tl.float32), float("-inf")))')

    def token_terms(self, x: str) -> str:
        return f"tl.sum({x}, 1).to(G_DTYPE)"

    def chunk_term(self) -> str:
        return "(tl.sum(b_dgc, 0) * b_gam_C).to(G_DTYPE)"

    def dg_rows(self) -> str:
        return "o_tok"

    def dg_mask(self) -> str:
        return "m_t"

    def program_decay(self) -> str:
        return "b_a = tl.exp(tl.load(g + i_h).to(tl.float32))" if self.kind == "constant" else ""

    def token_decay(self) -> str:
        return "b_a = tl.exp(tl.load(g + i_tok).to(tl.float32))" if self.kind == "scalar" else ""

    def apply_decay_column(self, x: str) -> str:
        return f"{x} = {x} * b_a"

    def walk_dg_term(self, x: str, op: str = "") -> str:
        if self.kind != "scalar":
            return ""
        if not op:
            return f"tl.store(dgc + i_part + i_tok, tl.sum({x}, 0))"
        return f"tl.store(dgc + i_part + i_tok, tl.load(dgc + i_part + i_tok) {op} tl.sum({x}, 0))"

    def finish_dg_partial(self) -> str:
        return "b_dg += tl.load(dgc + i_row)" if self.kind == "scalar" else ""

    def finish_dg_store(self) -> str:
        return "tl.store(dg + i_tok, b_dg)" if self.kind == "scalar" else ""

    def walk_dg_buffers(self) -> str:
        if self.kind == "constant":
            return "# dg per value block and sequence\ndgc, dgb = None, torch.empty(NV, N, H, **f32)"
        return ("# dg's per-token terms and its start <dht, S_T>\ndgc = torch.empty(NV, B, T, H, **f32)\n"
                "dgb = torch.empty(NV, N, H, **f32) if dht is not None else None")

    def walk_dg_output(self) -> str:
        if self.kind == "constant":
            return "# per sequence, summed below into the per-head constant's\ndg = torch.empty(N, H, **f32)"
        return "dg = torch.empty(B, T, H, **f32)"

    def walk_dg_result(self) -> str:
        return ("dg = dg.sum(0)\n" if self.kind == "constant" else "") + "dg = dg.to(g.dtype)"


@dataclasses.dataclass(frozen=True)
class VectorDecay(NoDecay):
    """A decay per token, head and feature, Γ_t [BT, BF] (b_gam_t [BF, BT] its transposed tile), Γ_C [BF]:
    the pairs' ratios differ by feature, so the pair sums run by 16-token blocks (the templates'
    scores_t, key_pairs, pairs_rows, pairs_cols), not as factors of whole tiles; the decay gradient
    [B, T, H, K]."""

    kind: str = "vector"
    output_pointers: ClassVar[str] = "st.gc, "
    output_blocks_kernel: ClassVar[str] = " chunked_output_blocks_kernel"

    @property
    def pair_macros(self) -> str:
        return "pairs/vector.jinja"

    @property
    def grad_macros(self) -> str:
        return "decay_grads/token.jinja"

    def rows_times(self, x: str, gam: str) -> str:
        return f"{x} * {gam}"

    def cols_times(self, x: str, gam: str) -> str:
        return f"{x} * {gam}_t"

    def state_times(self, x: str) -> str:
        return f"{x} * b_gam_C[:, None]"

    def load_chunk_decay(self, i_slot: str, name: str = "b_gam_C") -> str:
        return f"{name} = tl.load(gc + ({i_slot} * H + i_h) * F + o_f, mask=m_f, other=0.0)"

    def zero_chunk_decay(self, name: str) -> str:
        return f"{name} = tl.zeros([BF], dtype=tl.float32)"

    def chunk_decay_buffer(self) -> str:
        return "gc = torch.empty(n_slots, H, F, **f32)"

    def store_state_keys(self) -> str:
        return ("# [BT, BF] the keys of the state update, K ⊙ Γ_C/Γ, and Γ_C [BF] (slot i_s)\n"
                "tl.store(kr + o_tok[:, None] * F + o_f[None, :], (b_k * b_gam_rest).to(kr.dtype.element_ty), mask=m_tf)\n"
                "tl.store(gc + (i_s.to(tl.int64) * H + i_h) * F + o_f, b_gam_C, mask=m_f)")

    def beta_keys(self) -> str:
        return "# [BT, BF] diag(β) (K ⊙ Γ)\nb_y = b_k * b_gam * b_beta[:, None]"

    def output_scores(self) -> str:
        # whole-tile decay ratios exp(G_t - G_s) per feature do not factor out of P's dot: the output pass
        # takes a vector decay's chunks by their span (templates/chunked/output.py.jinja, output_blocks)
        raise ValueError("vector decay: the output pass has no whole-chunk scores (see chunked/output.py.jinja)")

    def token_terms(self, x: str) -> str:
        return f"({x}).to(G_DTYPE)"

    def chunk_term(self) -> str:
        return "(b_dgc * b_gam_C)[None, :].to(G_DTYPE)"

    def dg_rows(self) -> str:
        return "o_tok[:, None] * K + o_f[None, :]"

    def dg_mask(self) -> str:
        return "m_tf"

    def token_decay(self) -> str:
        return "# [BF, 1]\nb_a = tl.exp(tl.load(g + i_tok * K + o_f, mask=m_f, other=0.0).to(tl.float32))[:, None]"

    def apply_decay_column(self, x: str) -> str:
        return f"{x} = {x} * tl.reshape(b_a, [BF])"

    def walk_dg_term(self, x: str, op: str = "") -> str:
        if not op:
            return f"tl.store(dgc + (i_part + i_tok) * F + o_f, {x}, mask=m_f)"
        return ("p_dg = dgc + (i_part + i_tok) * F + o_f\n"
                f"tl.store(p_dg, tl.load(p_dg, mask=m_f, other=0.0) {op} {x}, mask=m_f)")

    def finish_dg_partial(self) -> str:
        return "b_dg += tl.load(dgc + i_row * F + o_f, mask=m_f, other=0.0)"

    def finish_dg_store(self) -> str:
        return "tl.store(dg + i_tok * K + o_f, b_dg, mask=m_f)"

    def walk_dg_buffers(self) -> str:
        return ("# dg's per-token terms and its start <dht, S_T>\ndgc = torch.empty(NV, B, T, H, F, **f32)\n"
                "dgb = torch.empty(NV, N, H, F, **f32) if dht is not None else None")

    def walk_dg_output(self) -> str:
        return "dg = torch.empty(B, T, H, K, **f32)"

    def walk_dg_result(self) -> str:
        return "dg = dg.to(g.dtype)"


@dataclasses.dataclass(frozen=True)
class AdditiveRule:
    """S <- Γ S + k v^T: no chunk-local transform; the backward's dk step applies the chain rule to
    dk itself and writes the decay gradient."""

    name: str = "additive"
    key_features: str = "b_k_hat"   # step 4's keys' features (the feature map's pieces kept for dk's chain rule)
    dk_out: str = "dk"              # step 4's key gradient: the op's
    dg_out: str = "dg"              # step 4's decay gradient: the op's
    dg_out_dtype: str = "dg.dtype.element_ty"   # and its dtype
    values_note: str = ""           # what the written values are, in a comment
    released_before_output: str = ""  # what ChunkedStates holds of the rule's prepare step that the output pass does not read

    @property
    def templates(self) -> str:
        """The folder of the rule's own templates (templates/rules/<name>/): macros.jinja, the chunked
        forward's prepare step (its macros, fwd_macros.jinja, and its host code in chunked_states,
        fwd_prepare.py.jinja), the chunked backward's header (bwd_header.py.jinja) and host code: step 1's
        recomputation (bwd_recompute.py.jinja), step 2's buffers (bwd_local.py.jinja) and from step 3 on
        (bwd_steps.py.jinja), and the recurrent backward's token steps (recurrent_bwd.jinja)."""
        return f"rules/{self.name}/"

    @property
    def macros(self) -> str:
        """The template of the rule's pieces that need the feature map's macros (the backward's
        key_features and keys_out), which the backward imports as `rules`."""
        return self.templates + "macros.jinja"

    def segments(self, decay):
        """The hook of the state passes' segments (a segment's end state from its start state): the
        decay's diagonal D S + E."""
        return decay

    def state_values(self, outputs: bool = False) -> str:
        """The forward state pass's values b_u [BT, BV] that the chunk writes into the state (outputs: the pass
        may compute the outputs, its OUTPUTS launch parameter; planner.output_in_states)."""
        return "# [BT, BV] the additive rule writes the values\n" + self.written_values()

    def written_values(self) -> str:
        """The output pass's values b_u [BT, BV] (or [16, BV], a block's) that the chunk writes."""
        return "b_u = tl.load(v + o_tok[:, None] * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)"

    def state_tiles(self) -> str:
        """Step 3's tiles of the rule's own state-gradient term."""
        return ""

    def state_update(self, decayed_dh: str) -> str:
        """Step 3's dS <- Γ_C dS + (Q̂ ⊙ Γ)^T dO (decayed_dh: Γ_C dS), and the rule's own term."""
        return f"b_dh = chunked_dot(b_qgt, b_do, DOT_PRECISION, {decayed_dh})"

    @property
    def recurrent_steps(self) -> str:
        """The template of the rule's token steps in the recurrent backward (walk, reverse, the last pass's
        partials, the launcher's buffers and a third walk), which it imports as `rule_steps`."""
        return self.templates + "recurrent_bwd.jinja"

    def token_values(self) -> str:
        """The token loop's (recurrent forward's) b_v [BV] that token i_tok writes into the decayed state b_h."""
        return ""

    def contiguous_inputs(self) -> str:
        """The backward's inputs of the rule's own, made contiguous (the launcher's q, k, v, g are already)."""
        return ""

    def saved(self) -> str:
        """The chunked forward's `saved` and `starts`, what it keeps for the backward (from its states st)."""
        return "saved, starts = None, None"

    # Step 4a (the dq step) reads h_c once, by value blocks (b_hct [BV, BF]): the rule's own products with it.
    def dq_start(self) -> str:
        """Before the loop over value blocks."""
        return ""

    def dq_value_block(self) -> str:
        """In it, value block o_v (b_hct loaded)."""
        return ""

    def dq_end(self) -> str:
        """After it."""
        return ""


@dataclasses.dataclass(frozen=True)
class DeltaRule(AdditiveRule):
    """S <- Γ S + β k (v - S^T k)^T: the UT transform per chunk; step 4 hands its shares of dk and of the
    decay gradient to step 5 (the UT transform's backward), which applies the chain rule."""

    name: str = "delta"
    key_features: str = "b_k"
    dk_out: str = "dk_part"
    dg_out: str = "dg_part"
    dg_out_dtype: str = "tl.float32"
    values_note: str = " (chunked_states_kernel's U)"
    released_before_output: str = ", w=None, ai=None, starts=None"

    def state_values(self, outputs: bool = False) -> str:
        # U is stored for the output pass and the backward's steps; a launch with OUTPUTS (the outputs
        # computed by this pass) has no reader of it: the backward computes its own
        store = "if not ENDS and not OUTPUTS:" if outputs else "if not ENDS:"
        return ("# [BT, BF] W, as stored\n"
                "b_w = tl.load(w + o_tok[:, None] * F + o_f[None, :], mask=m_t[:, None] & m_f[None, :], other=0.0)\n"
                "# [BT, BV] the values the chunk's delta updates write: U = U0 - W S. U0 is subtracted from the\n"
                "# product, not its accumulator: so Triton 3.6 prefetches it with W and the keys (a dot's\n"
                "# accumulator, it was a plain load in the loop that the dot waited on)\n"
                "b_u0 = tl.load(u + o_tok[:, None] * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)\n"
                "b_u = b_u0 - chunked_dot(b_w, b_h, DOT_PRECISION)\n"
                f"{store}\n"
                "    tl.store(u + o_tok[:, None] * V + o_v[None, :], chunked_cast(b_u, u.dtype.element_ty, DOT_PRECISION), mask=m_tv)")

    def segments(self, decay):
        # a chunk maps its start state by A = Γ_C - (K ⊙ Γ_C/Γ)^T W (U = U0 - W S), a matrix
        return TransitionSegments()

    def written_values(self) -> str:
        # chunked_states_kernel's U
        return "b_u = tl.load(u + o_tok[:, None] * V + o_v[None, :], mask=m_tv, other=0.0)"

    def state_tiles(self) -> str:
        # W^T, transposed by the load
        return "b_wt = tl.load(w + o_tok[None, :] * F + o_f[:, None], mask=m_f[:, None] & m_t[None, :], other=0.0)"

    def state_update(self, decayed_dh: str) -> str:
        return ("# (the float32 dU negated, not the stored W: the interpreter holds 16-bit floats as raw bits)\n"
                f"b_dh = chunked_dot(b_wt, -b_du, DOT_PRECISION, chunked_dot(b_qgt, b_do, DOT_PRECISION, {decayed_dh}))")

    def token_values(self) -> str:
        return ("b_beta = tl.load(beta + i_tok).to(tl.float32)\n"
                "# [BV] the delta rule's correction of v by what the decayed state already predicts\n"
                "b_v = b_beta * (b_v - tl.sum(b_h * b_k[:, None], 0))")

    def contiguous_inputs(self) -> str:
        return "beta = beta.contiguous()"

    def saved(self) -> str:
        # the rows of (I + A)^-1, where the backward's chunk divides the forward's (chunked_keeps_inverse),
        # and the states entering the segments (TransitionSegments) where the backward's pass starts from them
        return ("saved = st.ai if for_backward and chunked_keeps_inverse(launch) else None\n"
                "starts = st.starts if for_backward and chunked_keeps_starts(q, v, cu_seqlens, launch) else None")

    def dq_start(self) -> str:
        return "b_duh = tl.zeros([BT, BF], dtype=tl.float32)"

    def dq_value_block(self) -> str:
        return ("# [BT, BV] dU, as step 3 completed it\n"
                "b_du = tl.load(du + o_tok[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)\n"
                "b_duh = chunked_dot(b_du, b_hct, DOT_PRECISION, b_duh)")

    def dq_end(self) -> str:
        # dW = -dU h_c^T for step 5 (the UT transform's gradient of W)
        return ("# [BT, BF] dW = -dU h_c^T, step 5's (chunked_pass_dtype: it only enters dots there)\n"
                "tl.store(dw + o_tok[:, None] * F + o_f[None, :], (-b_duh).to(dw.dtype.element_ty), "
                "mask=m_t[:, None] & m_f[None, :])")


@dataclasses.dataclass(frozen=True)
class TransitionSegments:
    """The state passes' segments with the delta rule: a chunk maps its start state S to A S + K̃^T U0, A =
    Γ_C - (K ⊙ Γ_C/Γ)^T W (the backward's gradient by A^T), so a segment's end state is M S + E, M [F, F]
    the product of its chunks' A and E its end state from zeros. The first launch (ENDS) runs, beside each
    value block's E, the transition's column blocks: the same pass from the identity's columns (o_m) with
    the values U0 (the backward's dO and dU) zero, their loads masked off as lanes past V. A kernel of its
    own (kernel_lib.chunked_segment_starts_kernel) then walks the segments, S <- M S + E, and leaves in each
    E's row the state the next segment starts from, which the second launch loads."""

    matrix: ClassVar[bool] = True
    segment_transition_buffer: ClassVar[str] = "torch.empty(N, G - 1, H, F, F, **f32) if G > 1 else None"

    @staticmethod
    def ends_blocks(bv: str) -> str:
        """The ENDS launch's programs past the value blocks (at bv lanes): the transition's column blocks."""
        return f"ceil_div(F, {bv})"

    def segment_ends_start(self, x: str) -> str:
        return ("# the transition's columns o_m, from the identity's (the value blocks' programs: o_m < 0, from zeros)\n"
                "o_m = o_v - tl.cdiv(V, BV) * BV\n"
                f"{x} = tl.where(o_f[:, None] == o_m[None, :], 1.0, 0.0)")

    @staticmethod
    def segment_start(x: str, e: str, row: str, first: str, mask: str) -> str:
        """The second launch: x [BF, BV] <- the state a segment starts from, row `row` of e as
        chunked_segment_starts_kernel left it, unless the segment is the first walked (`first`)."""
        return (f"if not {first}:\n"
                f"    o_e = (i_n.to(tl.int64) * NE + {row}) * H + i_h\n"
                f"    {x} = tl.load({e} + o_e * F * V + o_f[:, None] * V + o_v[None, :], mask={mask}, other=0.0)")

    def segment_transition_start(self) -> str:
        return ""

    def segment_transition_step(self) -> str:
        return ""

    def segment_transition_store(self, d: str, x: str) -> str:
        return ("# the transition's column block (its programs' o_m in [0, F))\n"
                f"tl.store({d} + o_e * F * F + o_f[:, None] * F + o_m[None, :], {x}, mask=m_f[:, None] & ((o_m >= 0) & (o_m < F))[None, :])")


@dataclasses.dataclass(frozen=True)
class Mask:
    """A softmax spec's mask as the kernels apply it to a tile straddling its edge (FlexAttention's mask_mod):
    which key positions k a query at position q sees. causal: k <= q; sliding_window: also k > q - window;
    bidirectional: every key (a tile masks only keys past the sequence's end)."""

    kind: str = "causal"
    window: int = 0

    @property
    def macros(self) -> str:
        """The template of its tile ranges (templates/masks/<kind>.jinja: which key tiles a query block visits
        and which of them it masks, and the dk/dv pass's query tiles), imported as `mask_tiles`."""
        return f"masks/{self.kind}.jinja"

    def tile_mask(self, k: str, q: str, valid: str = "") -> str:
        """The tile's allowed pairs, k and q the key and query positions broadcast to the tile (as the
        template's layout has them), and with `valid` (keys within the sequence) where given."""
        terms = {"causal": [f"{k} <= {q}"], "sliding_window": [f"{k} <= {q}", f"{k} > {q} - {self.window}"],
                 "bidirectional": []}[self.kind]
        parts = ([valid] if valid else []) + [f"({t})" if len(terms) + bool(valid) > 1 else t for t in terms]
        return " & ".join(parts)


@dataclasses.dataclass(frozen=True)
class ScoreBias:
    """A softmax spec's bias on the scores (FlexAttention's score_mod): none, or a scalar decay's G[p] - G[j]
    of query position p and key j (forgetting attention), G the cumulative log decays as float32 pairs
    (g_hi, g_lo). Its kernel pieces are the macros of templates/bias/; here, what its kernels pass on."""

    kind: str = "none"

    @property
    def biased(self) -> bool:
        return self.kind != "none"

    @property
    def macros(self) -> str:
        """The template of its kernel pieces (templates/bias/), which the softmax templates import as `bias`."""
        return f"bias/{'decay' if self.biased else 'none'}.jinja"

    @property
    def pointers(self) -> str:
        """G's pairs, in a kernel's or a tile function's pointer arguments."""
        return "g_hi, g_lo, " if self.biased else ""

    @property
    def query_carry(self) -> str:
        """G at a query block's positions, carried into the key-tile functions."""
        return "b_ghq, b_glq, " if self.biased else ""

    @property
    def key_carry(self) -> str:
        """G at a key block's positions and at its last real key, carried into the query-tile functions."""
        return "b_ghk, b_glk, b_ghr, b_glr, " if self.biased else ""

    @property
    def grad_pointers(self) -> tuple[str, str]:
        """The backward's dq and dk/dv kernels' pointers to the bias's gradient: dS's row sums and minus its column sums."""
        return ("dgq, ", "dgk, ") if self.biased else ("", "")

    @property
    def fwd_params(self) -> tuple[str, ...]:
        """The forward launcher's own parameters: a serving call's G pairs of the cache, in place of g."""
        return ("g_pairs=None",) if self.biased else ()

    @property
    def append_pointers(self) -> str:
        """The serving append's pointers to the new positions' G pairs (before the cache's)."""
        return "g_new_hi, g_new_lo, " if self.biased else ""

    @property
    def append_lanes(self) -> tuple[str, ...]:
        """The serving append's lanes of its own beside the keys' KC and values' VC (each a constexpr dim X with a
        block BX): G's, GC = the query heads."""
        return ("GC",) if self.biased else ()

    @property
    def new_pointers(self) -> str:
        """A decode call's forward kernel, appending its new keys and values itself, takes the new positions'
        log decays g_new too: each program continues the slot's last G by them, for its queries, and the
        programs that read the new positions store them."""
        return "g_new, " if self.biased else ""

    @property
    def new_decays(self) -> str:
        """What a serving call hands its append: the new positions' log decays g, or nothing."""
        return "g" if self.biased else "None"


@dataclasses.dataclass(frozen=True)
class FeatureMap:
    """A linear spec's feature map as the kernels apply it to q and k (before the l2 norm, which any map may be
    followed by): identity; elementwise, phi and its derivative the module's @triton.jit functions (elu+1, relu,
    an expression); favor_plus, Performer's random features exp(omega x' - |x'|^2 / 2) / sqrt(F), computed by dots
    from omega (loaded once per program). Its pieces are the macros of templates/features/<kind>.jinja."""

    kind: str = "identity"

    @property
    def macros(self) -> str:
        """The template of its pieces (the map of a row, a tile and a transposed tile, omega's loads, and their
        backward), which macros.jinja imports as `fmap`."""
        return f"features/{self.kind}.jinja"

    @property
    def features_by_dot(self) -> bool:
        """Whether a tile's features are a dot's result (FAVOR+): Triton 3.4-3.7 miscompile a tl.trans of one on
        Hopper, so a kernel that needs them transposed loads the raw tile transposed and maps it again."""
        return self.kind == "favor_plus"


def feature_hook(feature: str) -> FeatureMap:
    """The hook of a linear spec's feature map as the kernels see it: identity | elementwise | favor_plus."""
    if feature not in ("identity", "elementwise", "favor_plus"):
        raise ValueError(f"feature: {feature!r} is not allowed; allowed: identity, elementwise, favor_plus")
    return FeatureMap(feature)


def bias_hook(decay: str) -> ScoreBias:
    """The hook of a softmax spec's score bias, from its decay: none | scalar."""
    if decay not in ("none", "scalar"):
        raise ValueError(f"decay: {decay!r} is not allowed for softmax attention; allowed: none, scalar")
    return ScoreBias("none" if decay == "none" else "decay")


def mask_hook(mask: str, window: int = 0) -> Mask:
    """The hook of a softmax spec's mask: causal | sliding_window | bidirectional."""
    if mask not in ("causal", "sliding_window", "bidirectional"):
        raise ValueError(f"mask: {mask!r} is not allowed; allowed: causal, sliding_window, bidirectional")
    return Mask(mask, window)


def decay_hook(decay: str) -> NoDecay:
    """The hook of a spec's decay: none | constant | scalar | vector."""
    hooks = {"none": NoDecay(), "constant": ScalarDecay("constant"), "scalar": ScalarDecay(), "vector": VectorDecay()}
    if decay not in hooks:
        raise ValueError(f"decay: {decay!r} is not allowed; allowed: {', '.join(hooks)}")
    return hooks[decay]


def rule_hook(update: str) -> AdditiveRule:
    """The hook of a spec's update rule: additive | delta."""
    hooks = {"additive": AdditiveRule(), "delta": DeltaRule()}
    if update not in hooks:
        raise ValueError(f"update: {update!r} is not allowed; allowed: {', '.join(hooks)}")
    return hooks[update]
