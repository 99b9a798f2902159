"""Code generation: committed modules match a fresh compile, the source is readable and
valid for any legal spec, and the CLI regenerates byte-identically."""
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from attngen import __version__, codegen, kernel_lib, load_spec, planner
from attngen.cli import main

from specs import shipped, stem
from strategies import legal_specs

ROOT = Path(__file__).resolve().parent.parent
SPECS = shipped()


@pytest.mark.parametrize("path", SPECS, ids=stem)
def test_committed_module_is_a_fresh_compile(path):
    spec = load_spec(path)
    committed = ROOT / "generated" / f"{spec.name}.py"
    assert committed.exists(), f"generated/{spec.name}.py is missing: run `attngen compile specs/*.yaml`"
    assert committed.read_text() == codegen.render(spec), \
        f"generated/{spec.name}.py differs from a fresh compile: run `attngen compile specs/*.yaml`"


def test_generated_has_no_stale_files():
    names = {load_spec(p).name for p in SPECS}
    stale = {p.stem for p in (ROOT / "generated").glob("*.py")} - names
    assert not stale, f"generated/ holds modules of no shipped spec: {sorted(stale)}"


@pytest.mark.parametrize("path", SPECS, ids=stem)
def test_provenance_header(path):
    spec = load_spec(path)
    source = codegen.render(spec)
    head = "\n".join(source.splitlines()[:6])
    assert spec.name in head and spec.hash in head and __version__ in head
    assert f"FORMS = {tuple(f.name for f in planner.plan(spec).forms)}" in source
    compile(source, f"{spec.name}.py", "exec")


def test_cli_compile_is_byte_identical(tmp_path):
    assert main(["compile", *map(str, SPECS), "-o", str(tmp_path)]) == 0
    for path in SPECS:
        spec = load_spec(path)
        assert (tmp_path / f"{spec.name}.py").read_bytes() == codegen.render(spec).encode()
    first = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert main(["compile", *map(str, SPECS), "-o", str(tmp_path)]) == 0
    assert first == {p.name: p.read_bytes() for p in tmp_path.iterdir()}


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(legal_specs())
def test_any_legal_spec_renders_valid_python(spec_dict):
    spec = load_spec(spec_dict)
    source = codegen.render(spec)
    compile(source, f"{spec.name}.py", "exec")
    assert "{{" not in source and "{%" not in source
    assert source == codegen.render(spec)  # deterministic


def test_kernel_lib_exports_its_public_definitions():
    """kernel_lib.__all__ (what codegen may import into a module) names every public top-level function
    and constant kernel_lib defines, and nothing else."""
    import ast

    from attngen import kernel_lib
    tree = ast.parse(Path(kernel_lib.__file__).read_text())
    defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    defined |= {t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets
                if isinstance(t, ast.Name) and t.id != "__all__"}
    assert sorted(kernel_lib.__all__) == sorted(n for n in defined if not n.startswith("_"))


def test_host_integer_helpers_match_triton():
    """kernel_lib's ceil_div and pow2_ceil, which the launchers call in place of Triton's ConstexprFunctions
    (microseconds a call on the host), give Triton's integers."""
    import triton

    from attngen.kernel_lib import ceil_div, pow2_ceil
    assert all(pow2_ceil(n) == triton.next_power_of_2(n) for n in range(1, 5000))
    assert all(ceil_div(a, b) == triton.cdiv(a, b) for a in range(0, 600) for b in range(1, 70))
    assert pow2_ceil(0) == 1 and pow2_ceil(1 << 40) == 1 << 40 and pow2_ceil((1 << 40) + 1) == 1 << 41


@pytest.mark.parametrize("path", sorted((ROOT / "generated").glob("*.py")), ids=lambda p: p.stem)
def test_launchers_call_no_triton_constexpr_function(path):
    """The generated host code does its grid arithmetic in plain Python (kernel_lib.ceil_div, pow2_ceil)."""
    source = path.read_text()
    assert "triton.cdiv(" not in source and "triton.next_power_of_2(" not in source


@pytest.mark.parametrize("path", [Path(kernel_lib.__file__)] + sorted((ROOT / "generated").glob("*.py")),
                         ids=lambda p: p.stem)
def test_no_triton_function_ends_with_a_barrier(path):
    """A tl.debug_barrier() as the last statement of a @triton.jit helper is not in Triton 3.6's compiled code
    when the helper is inlined (the decode forward's append had no bar.sync: BENCHMARKS.md 2026-12-07,
    sixteenth run): a barrier goes at the call site, after the helper."""
    import ast

    def is_barrier(node):
        return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Attribute) and node.value.func.attr == "debug_barrier")

    tree = ast.parse(path.read_text())
    jitted = [f for f in tree.body if isinstance(f, ast.FunctionDef)
              and any("jit" in ast.unparse(d) for d in f.decorator_list)]
    assert jitted
    ending = [f.name for f in jitted if is_barrier(f.body[-1])]
    assert not ending, f"{path.name}: @triton.jit functions ending with tl.debug_barrier(): {ending}"


def test_kernel_lib_calls_reads_code_not_comments_or_strings():
    source = ("x = chunked_cast(y)  # chunked_dot\ns = 'floor_log_decay' + \"it's # pow2_floor\"\n"
              '"""interpreted\n"""\nLOG2E * pow2_floorx\n')
    assert codegen.kernel_lib_calls(source) == ("LOG2E", "chunked_cast")


@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(legal_specs())
def test_kernel_lib_calls_reads_the_names_a_tokenizer_reads(spec_dict):
    """kernel_lib_calls' one regex pass reads, in a rendered module, the kernel_lib names Python's
    tokenizer reads as NAME tokens (comments and strings apart)."""
    import io
    import tokenize

    from attngen import kernel_lib
    source = codegen.render(load_spec(spec_dict))
    names = {t.string for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.NAME}
    assert codegen.kernel_lib_calls(source) == tuple(sorted(names & set(kernel_lib.__all__)))


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(legal_specs())
def test_module_imports_the_kernel_lib_names_it_calls(spec_dict):
    """A generated module imports from attngen.kernel_lib exactly the names its code uses: each one
    resolves in the loaded module, and no unused one is imported."""
    import re

    from attngen import kernel_lib
    spec = load_spec(spec_dict)
    source = codegen.render(spec)
    block = re.search(r"^from attngen\.kernel_lib import \(([^)]*)\)", source, re.M)
    imported = tuple(n.strip() for n in block.group(1).split(",") if n.strip()) if block else ()
    rest = source if block is None else source[:block.start()] + source[block.end():]
    assert imported == codegen.kernel_lib_calls(rest)
    module = codegen.load_module(spec)
    assert all(getattr(module, n) is getattr(kernel_lib, n) for n in imported)


def _launches(module, fn: str) -> list[str]:
    """The kernels a generated launcher starts, in source order (chunked_states and the output pass's
    CHUNKED_OUTPUT_KERNELS expanded), each step once; kernel_lib's kernels are parts of a step."""
    import inspect
    import re
    out = []
    pattern = r"\b(chunked_\w+_kernel)\[|(?<!def )\bchunked_states\(|\bin (CHUNKED_OUTPUT_KERNELS):"
    for m in re.finditer(pattern, inspect.getsource(getattr(module, fn))):
        if m.group(1) in kernel_lib.__all__:
            continue  # a helper within a step (the delta rule's segment starts between the state pass's launches)
        kernels = ([m.group(1)] if m.group(1) else [k.__name__ for k in module.CHUNKED_OUTPUT_KERNELS] if m.group(2)
                   else _launches(module, "chunked_states"))
        for kernel in kernels:
            # a step's two launches (the state passes' segment ends, then the states) are one step, and so is a
            # step of both of chunked_fwd's branches (the outputs in the state pass, or an output pass after it)
            if kernel not in out:
                out.append(kernel)
    return out


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(legal_specs())
def test_explained_chunked_steps_are_the_generated_launches(spec_dict):
    """`attngen explain`'s chunked kernel steps (planner.chunked_steps) are the kernels the generated
    chunked_fwd and chunked_bwd launch, in that order, and every chunked kernel of the module is one."""
    spec = load_spec(spec_dict)
    forward, backward = planner.chunked_steps(spec)
    module = codegen.load_module(spec)
    if not hasattr(module, "chunked_fwd"):
        assert forward == backward == ()
        return
    assert [k for k, _ in forward] == _launches(module, "chunked_fwd")
    assert [k for k, _ in backward] == (_launches(module, "chunked_bwd") if module.CHUNKED_BACKWARD else [])
    defined = {n for n in vars(module) if n.startswith("chunked_") and n.endswith("_kernel") and n not in kernel_lib.__all__}
    assert defined == {k for k, _ in forward + backward} | ({"chunked_output_kernel"} if forward else set())


def test_every_step_template_is_a_step_the_planner_names():
    """templates/chunked/ and templates/chunked_bwd/ hold one template (<step>.py.jinja) per step kernel of
    planner.chunked_steps and nothing else (over the shipped specs, which take every step), beside macro files
    the steps share (chunked_bwd/step4.jinja)."""
    templates = ROOT / "attngen" / "templates"
    fwd, bwd = set(), set()
    for path in SPECS:
        ks = planner.kernel_spec(load_spec(path))
        fwd |= set(ks.chunked_fwd_steps)
        bwd |= set(ks.chunked_bwd_steps)
    assert fwd == {p.name.removesuffix(".py.jinja") for p in (templates / "chunked").glob("*.py.jinja")}
    assert bwd == {p.name.removesuffix(".py.jinja") for p in (templates / "chunked_bwd").glob("*.py.jinja")}
    assert {p.name for p in (templates / "chunked_bwd").glob("*.jinja")} - {p.name for p in (templates / "chunked_bwd").glob("*.py.jinja")} == {"step4.jinja"}


def test_the_chunk_term_in_the_dq_step():
    """The decay gradient's chunk term sum_v h_c ⊙ dS is summed in the dq step, which streams h_c anyway
    (it loads dS beside it and stores dgc); the dk step loads the sums and reads no h_c. Where step 4 is
    one kernel (planner.fused_dq_dk: gated_deltanet, mamba2, retnet), it reads h_c and dS and keeps the chunk
    term and the query terms in registers: no dgc, dgq, nor dq and dk steps; it stores the rule's outputs (the
    delta rule's shares for its UT step, the additive rule's dk and dg)."""
    import re

    fused = 0
    for path in SPECS:
        spec = load_spec(path)
        if not spec.is_linear or spec.decay == "none" or spec.mask != "causal":
            continue
        source = codegen.render(spec)
        signature = lambda name: re.search(rf"def {name}\(\n    # pointers\n    (.*)\n", source).group(1)  # noqa: E731
        assert "chunked_bwd_dgc_kernel" not in source
        if planner.fused_dq_dk(spec):
            fused += 1
            dqk = signature("chunked_bwd_dqk_kernel").split(", ")
            outputs = {"dk_part", "dg_part"} if spec.rule.ut_transform else {"dk", "dg"}
            assert {"h", "ds", "dq"} | outputs <= set(dqk) and not {"dgc", "dgq"} & set(dqk), (path, dqk)
            assert "def chunked_bwd_dq_kernel" not in source and "def chunked_bwd_dk_kernel" not in source
            continue
        dq, dk = signature("chunked_bwd_dq_kernel").split(", "), signature("chunked_bwd_dk_kernel").split(", ")
        assert {"h", "ds", "dgc"} <= set(dq), (path, dq)
        assert "dgc" in dk and "h" not in dk, (path, dk)
    assert fused == 3


def test_hooks_of_every_rule_and_decay():
    """planner.kernel_spec fills the update rule's, the decay's, the feature map's and (softmax) the mask's and the
    score bias's hook objects (attngen/hooks.py) the templates take their fragments from; an unknown one is a clear error."""
    from attngen import hooks

    for path in SPECS:
        spec = load_spec(path)
        ks = planner.kernel_spec(spec)
        assert ks.decay_hook.kind == spec.decay and ks.decay_hook.decayed == (spec.decay != "none")
        assert (ks.rule_hook.name == spec.update) if spec.is_linear else ks.rule_hook is None
        assert ks.mask_hook is None if spec.is_linear else (ks.mask_hook.kind, ks.mask_hook.window) == (
            spec.mask, spec.window or 0)
        assert ks.feature_hook.kind == ks.feature and ks.feature_hook.features_by_dot == (spec.feature_map == "favor_plus")
    # a feature map's pieces: one template per map kind, the same macros (identity's and FAVOR+'s projections empty
    # where they have none)
    maps = [(ROOT / "attngen" / "templates" / hooks.feature_hook(f).macros).read_text()
            for f in ("identity", "elementwise", "favor_plus")]
    assert len({tuple(sorted(re.findall(r"{% macro (\w+)\(", text))) for text in maps}) == 1
    with pytest.raises(ValueError, match="feature: 'relu' is not allowed; allowed: identity, elementwise, favor_plus"):
        hooks.feature_hook("relu")
    # a softmax mask on a tile's edge (FlexAttention's mask_mod): the allowed pairs, with the keys' bound
    assert hooks.mask_hook("causal").tile_mask("k", "q", valid="m") == "m & (k <= q)"
    assert hooks.mask_hook("causal").tile_mask("k", "q") == "k <= q"
    assert hooks.mask_hook("sliding_window", 64).tile_mask("k", "q") == "(k <= q) & (k > q - 64)"
    assert hooks.mask_hook("bidirectional").tile_mask("k", "q", valid="m") == "m"
    with pytest.raises(ValueError, match="mask: 'local' is not allowed; allowed: causal, sliding_window, bidirectional"):
        hooks.mask_hook("local")
    # and its tile ranges (which tiles a block visits, which it masks): one template per mask, the same macros
    ranges = [(ROOT / "attngen" / "templates" / hooks.mask_hook(m).macros).read_text()
              for m in ("causal", "sliding_window", "bidirectional")]
    assert {tuple(sorted(re.findall(r"{% macro (\w+)\(", text))) for text in ranges} == {("key_tiles", "query_tiles")}
    # a softmax bias on the scores (FlexAttention's score_mod): a decay's kernel pieces in templates/bias/decay.jinja,
    # none's the same macros, empty
    assert (hooks.bias_hook("none").pointers, hooks.bias_hook("scalar").pointers) == ("", "g_hi, g_lo, ")
    assert [hooks.bias_hook(d).macros for d in ("none", "scalar")] == ["bias/none.jinja", "bias/decay.jinja"]
    biased, plain = ((ROOT / "attngen" / "templates" / hooks.bias_hook(d).macros).read_text() for d in ("scalar", "none"))
    assert set(re.findall(r"{% macro (\w+)\(\)", biased)) == set(re.findall(r"{% macro (\w+)\(\)", plain)) != set()
    with pytest.raises(ValueError, match="decay: 'vector' is not allowed for softmax attention; allowed: none, scalar"):
        hooks.bias_hook("vector")
    assert hooks.decay_hook("vector").dg_rows() == "o_tok[:, None] * K + o_f[None, :]"
    assert hooks.decay_hook("constant").rows_times("x", "g") == "x * g[:, None]"
    assert hooks.decay_hook("none").state_times("b_dh") == "b_dh"
    assert "b_wt" in hooks.rule_hook("delta").state_update("b_dh") and hooks.rule_hook("additive").state_tiles() == ""
    # a stored Γ_C into a name of the caller's (the state-gradient pass loads the next chunk's ahead)
    assert hooks.decay_hook("scalar").load_chunk_decay("(s)", "b_next") == "b_next = tl.load(gc + (s) * H + i_h)"
    assert hooks.decay_hook("vector").zero_chunk_decay("b_next") == "b_next = tl.zeros([BF], dtype=tl.float32)"
    # the state passes' Γ_C an iteration ahead: the first chunk's before the loop, the next one's in it
    assert hooks.decay_hook("scalar").first_chunk_decay_ahead("boc", "NT > 0") == (
        "b_gam_C_next = 0.0\nif NT > 0:\n    b_gam_C_next = tl.load(gc + boc * H + i_h)")
    assert hooks.decay_hook("scalar").next_chunk_decay("(s)").splitlines()[::2] == [
        "b_gam_C = b_gam_C_next", "b_gam_C_next = tl.load(gc + (s) * H + i_h)"]
    assert hooks.decay_hook("none").first_chunk_decay_ahead("boc", "NT > 0") == ""
    # the pair sums: one template per decay, each with the macros the step templates call
    templates = ROOT / "attngen" / "templates"
    assert {hooks.decay_hook(d).pair_macros for d in ("none", "constant", "scalar", "vector")} == {
        f"pairs/{p.name}" for p in (templates / "pairs").glob("*.jinja")}
    assert hooks.decay_hook("constant").pair_macros == hooks.decay_hook("scalar").pair_macros
    for path in (templates / "pairs").glob("*.jinja"):
        text = path.read_text()
        for macro in ("ut_block_decays(i)", "ut_block_pair(i, j)", "scores_t()", "key_pairs(keys, keys_t)",
                      "pairs_rows(dM, keys, out)", "pairs_cols(dMt, x, x_tile, out, scaled)"):
            assert f"{{% macro {macro} -%}}" in text, (path.name, macro)
    # the decay gradient's terms: by token (scalar, vector), one sum (constant), none
    assert [hooks.decay_hook(d).grad_macros for d in ("none", "constant", "scalar", "vector")] == [
        "decay_grads/none.jinja", "decay_grads/constant.jinja", "decay_grads/token.jinja", "decay_grads/token.jinja"]
    chunked = [p for p in (templates / "decay_grads").glob("*.jinja") if not p.name.startswith("walk_")]
    assert {f"decay_grads/{p.name}" for p in chunked} == {
        "decay_grads/none.jinja", "decay_grads/constant.jinja", "decay_grads/token.jinja"}
    for path in chunked:
        text = path.read_text()
        for macro in ("query_terms(decay, kept=False)", "output_terms(decay, kf, dg_out, dg_dtype, kept=False)",
                      "transform_terms(decay)"):
            assert f"{{% macro {macro} -%}}" in text, (path.name, macro)
    assert (hooks.rule_hook("delta").dg_out_dtype, hooks.rule_hook("additive").dg_out_dtype) == (
        "tl.float32", "dg.dtype.element_ty")
    # a folder of templates per rule: the pieces that need the feature map's macros, the forward's prepare
    # step (its macros and host code), the backward's header and its host steps from step 3 on
    assert {hooks.rule_hook(r).templates for r in ("additive", "delta")} == {
        f"rules/{p.name}/" for p in (templates / "rules").iterdir()}
    for rule in ("additive", "delta"):
        folder = templates / hooks.rule_hook(rule).templates
        assert {p.name for p in folder.iterdir()} == {"macros.jinja", "fwd_macros.jinja", "fwd_prepare.py.jinja",
                                                   "bwd_header.py.jinja", "bwd_recompute.py.jinja", "bwd_local.py.jinja",
                                                   "bwd_steps.py.jinja", "recurrent_bwd.jinja"}
        text = (templates / hooks.rule_hook(rule).macros).read_text()
        assert "{% macro key_features() -%}" in text and "{% macro keys_out() -%}" in text, rule
        # the recurrent backward's token steps: every rule defines each macro the template calls
        steps = (templates / hooks.rule_hook(rule).recurrent_steps).read_text()
        for macro in ("formulas", "walk", "reverse", "partials_init", "partials_add", "partials_store", "buffers",
                      "third_walk"):
            assert f"{{% macro {macro}()" in steps, (rule, macro)
    # the token loop's pieces: none where the rule or decay has no such piece
    assert hooks.rule_hook("additive").token_values() == "" and "b_beta" in hooks.rule_hook("delta").token_values()
    assert [hooks.decay_hook(d).token_decay() != "" for d in ("none", "constant", "scalar", "vector")] == [
        False, False, True, True]
    assert [hooks.decay_hook(d).program_decay() != "" for d in ("none", "constant", "scalar", "vector")] == [
        False, True, False, False]
    assert hooks.decay_hook("vector").apply_decay_column("b_z") == "b_z = b_z * tl.reshape(b_a, [BF])"
    assert hooks.decay_hook("scalar").apply_decay("b_h", "S'_t") == "# S'_t\nb_h = b_h * b_a"
    # per-token decay-gradient terms: scalar summed, vector by feature, none for a constant (forward mode)
    assert hooks.decay_hook("scalar").walk_dg_term("x", "-") == (
        "tl.store(dgc + i_part + i_tok, tl.load(dgc + i_part + i_tok) - tl.sum(x, 0))")
    assert hooks.decay_hook("vector").walk_dg_term("x") == "tl.store(dgc + (i_part + i_tok) * F + o_f, x, mask=m_f)"
    assert hooks.decay_hook("constant").walk_dg_term("x", "+") == hooks.decay_hook("none").walk_dg_term("x") == ""
    assert hooks.decay_hook("constant").walk_dg_result() == "dg = dg.sum(0)\ndg = dg.to(g.dtype)"
    # the state passes' segments: D S + E, D = 1 without a decay (and no D kept)
    assert hooks.decay_hook("none").segment_carry("b_h", "hd", "E") == "b_h += E"
    assert hooks.decay_hook("vector").segment_carry("b_h", "hd", "E").splitlines()[1] == "b_h = b_h * b_dj[:, None] + E"
    assert hooks.decay_hook("constant").segment_carry_column("b_z", "e") == "b_z = b_z * b_dj + e"
    assert [hooks.decay_hook(d).segment_transition_store("hd", "b_h") == "" for d in ("none", "constant", "scalar", "vector")] == [
        True, False, False, False]
    # the delta rule's segments: M S + E, M a matrix of its own (TransitionSegments), whatever the decay
    segs = hooks.DeltaRule().segments(hooks.decay_hook("scalar"))
    assert segs.matrix and not hooks.AdditiveRule().segments(hooks.decay_hook("scalar")).matrix
    assert segs.segment_transition_step() == "" and "o_m" in segs.segment_transition_store("hd", "b_h")
    assert hooks.decay_hook("none").column_times("b_z") == "b_z" and hooks.decay_hook("scalar").column_times("b_z") == (
        "b_z * b_gam_C")
    # the recurrent backward's decay-gradient mechanism per decay: none, forward mode (constant), per token
    assert [hooks.decay_hook(d).walk_grad_macros for d in ("none", "constant", "scalar", "vector")] == [
        "decay_grads/walk_none.jinja", "decay_grads/walk_constant.jinja", "decay_grads/walk_token.jinja",
        "decay_grads/walk_token.jinja"]
    for path in sorted((templates / "decay_grads").glob("walk_*.jinja")):
        text = path.read_text()
        for macro in ("walk_start", "walk_tangent", "walk_query_term", "walk_end", "finish_start"):
            assert f"{{% macro {macro}()" in text, (path.name, macro)
    with pytest.raises(ValueError, match="decay: 'linear' is not allowed; allowed: none, constant, scalar, vector"):
        hooks.decay_hook("linear")
    with pytest.raises(ValueError, match="update: 'gated' is not allowed; allowed: additive, delta"):
        hooks.rule_hook("gated")


def test_an_empty_hook_fragment_leaves_no_line():
    """`{{ fragment | piece(n) }}` on a template line of its own: a fragment's later lines indented to its
    first; an empty one drops the line (no blank line where a rule or decay has no such piece); an empty
    fragment beside other text on its line is an error, not a stray byte in the module."""
    import jinja2

    from attngen import codegen
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["piece"] = codegen.piece
    template = env.from_string("def f():\n    a = 1\n    {{ x | piece(4) }}\n    return a\n")
    assert codegen._tidy(template.render(x="")) == "def f():\n    a = 1\n    return a\n"
    assert codegen._tidy(template.render(x="# two\na = 2")) == "def f():\n    a = 1\n    # two\n    a = 2\n    return a\n"
    with pytest.raises(ValueError, match="empty hook fragment beside other text"):
        codegen._tidy(env.from_string("    a = {{ x | piece(4) }}\n").render(x=""))
    # at the end of a macro's output that its caller trims, an empty fragment goes with the newlines before it
    # (as an absent {% if %} part's would): no blank line after the macro's last line
    macro = env.from_string("{% macro head() %}\nb = 2\n\n{{ x | piece(0) }}\n{%- endmacro %}"
                            "def f():\n    {{ head() | indent(4) | trim }}\n    return b\n")
    assert codegen._tidy(macro.render(x="")) == "def f():\n    b = 2\n    return b\n"
    assert codegen._tidy(macro.render(x="c = 3")) == "def f():\n    b = 2\n\n    c = 3\n    return b\n"
