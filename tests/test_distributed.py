"""Context parallelism (attngen.distributed) on gloo ranks: outputs, final states and every
gradient of each rank's shard equal the single-process call's, for every shipped spec, random
shard lengths, packed sequences across shard boundaries; one case per method through the Triton
interpreter; and DDP + context-parallel training equal to single-process training.

The ranks are forked once per rank count (a process per rank; fork, not spawn: a spawned process
imports torch again, seconds on a CI core); each runs every case and writes its rows to a file.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import random
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import attngen
import attngen.distributed
from attngen.distributed import ContextParallel
from attngen.spec import load_spec
from attngen.testing import FLOAT64_RTOL, Shape, random_inputs, rel_error, tolerance

REPO = Path(__file__).resolve().parents[1]
SPECS = sorted(p.stem for p in (REPO / "specs").glob("*.yaml"))
QKV = ("q", "k", "v")


@dataclasses.dataclass(frozen=True)
class Case:
    spec: str                       # a shipped spec's name
    packed: bool
    seed: int
    method: str | None = None       # None: the planner's
    backend: str = "torch"          # torch: float64 PyTorch forms; triton: float32 kernels (interpreter)
    window: int | None = None       # overrides a sliding window spec's window

    @property
    def id(self) -> str:
        extra = [x for x in (self.method, self.backend if self.backend != "torch" else None,
                             f"window{self.window}" if self.window else None) if x]
        return "-".join([self.spec, "packed" if self.packed else "batch", *extra])


def _cases(ranks: int) -> list[Case]:
    cases = [Case(name, packed, seed=ranks * 100 + i) for i, name in enumerate(SPECS) for packed in (False, True)]
    if ranks == 2:
        # the general method where the planner takes the cheaper one: every additive spec
        cases += [Case(name, True, seed=300 + i, method="affine") for i, name in
                  enumerate(("linear_transformer", "mamba2", "retnet", "gla", "performer"))]
        cases += [Case("sliding_window", packed, seed=310 + packed, window=5) for packed in (False, True)]
        cases += [Case(name, packed, seed=320 + i, backend="triton")
                  for i, (name, packed) in enumerate((("gated_deltanet", False), ("mamba2", True),
                                                      ("softmax_causal", True)))]
    return cases


CASES = {2: _cases(2), 4: _cases(4)}


def layout(rng: random.Random, ranks: int, packed: bool) -> tuple[list[int], tuple[int, ...] | None]:
    """Random shard lengths and, packed, offsets such that: a sequence continues from rank 0 to
    rank 1; rank 1 holds a sequence's end and another's start; a sequence runs through a whole
    shard (ranks > 2) and ends exactly at a shard's end, so the next shard starts a sequence;
    every shard after rank 1 but those holds a sequence's start inside."""
    lengths = [rng.randint(5, 11) for _ in range(ranks)]
    if not packed:
        return lengths, None
    bounds = [sum(lengths[:j]) for j in range(ranks + 1)]
    cu = {0, bounds[-1]}
    for j in range(ranks):
        if ranks > 2 and j == ranks - 2:
            cu.add(bounds[j + 1])        # the sequence through this whole shard ends at its end
            continue
        cu.add(rng.randint(bounds[j] + 1, bounds[j + 1] - 1))
    return lengths, tuple(sorted(cu))


def _loss_weights(outs: dict, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(t.shape, generator=gen, dtype=torch.float64) for n, t in outs.items()}


def _run(fn, spec, inputs: dict, weights: dict | None) -> tuple[dict, dict]:
    """fn(**inputs) and the gradients of sum(out * weight) wrt every floating input."""
    leaves = {n: t.detach().clone().requires_grad_(True) if t is not None and t.is_floating_point() else t
              for n, t in inputs.items()}
    if spec.is_linear:
        o, s = fn(**leaves, output_final_state=True)
        outs = {"o": o, "final_state": s}
    else:
        outs = {"o": fn(**leaves)}
    weights = weights or _loss_weights(outs, seed=1)
    loss = sum((t * weights[n].to(t)).sum() for n, t in outs.items())
    names = [n for n, t in leaves.items() if isinstance(t, torch.Tensor) and t.requires_grad]
    grads = torch.autograd.grad(loss, [leaves[n] for n in names], allow_unused=True)
    result = {n: t.detach() for n, t in outs.items()}
    result.update({"d" + n: (gr if gr is not None else torch.zeros_like(leaves[n])) for n, gr in zip(names, grads)})
    return result, weights


def _rows(cu, bounds, rank, ranks, batch) -> tuple[list[int], list[int]]:
    """The sequences (rows of the initial and final states) that start and end in a rank's shard."""
    a, b = bounds[rank], bounds[rank + 1]
    if cu is None:
        return (list(range(batch)) if rank == 0 else []), (list(range(batch)) if rank == ranks - 1 else [])
    n = len(cu) - 1
    return [i for i in range(n) if a <= cu[i] < b], [i for i in range(n) if a < cu[i + 1] <= b]


def run_case(case: Case, rank: int, ranks: int, group) -> dict[str, list]:
    """{output or gradient: [error, tolerance]} of this rank's shard against the single-process call
    (float64: to float64 rounding; float32 kernels: within tolerance() of the single-process
    kernels' own error against float64)."""
    spec = load_spec(REPO / "specs" / f"{case.spec}.yaml")
    if case.window:
        spec = load_spec(dict(spec.to_dict(), window=case.window))
    op = attngen.load(spec)
    lengths, cu = layout(random.Random(case.seed), ranks, case.packed)
    bounds = [sum(lengths[:j]) for j in range(ranks + 1)]
    batch = 1 if case.packed else 2
    shape = Shape(batch, bounds[-1], 2, 8, 6, kv_heads=1 if case.spec == "softmax_causal" else None, cu_seqlens=cu)
    inputs = random_inputs(spec, shape, seed=case.seed)
    os.environ["ATTNGEN_BACKEND"] = "torch"
    want, weights = _run(op, spec, inputs, None)
    os.environ["ATTNGEN_BACKEND"] = case.backend
    dtype = torch.float64 if case.backend == "torch" else torch.float32
    inputs = {n: t.to(dtype) if n in QKV else t for n, t in inputs.items()}
    lowp = None if dtype == torch.float64 else _run(op, spec, inputs, weights)[0]

    starting, ending = _rows(cu, bounds, rank, ranks, batch)
    a, b = bounds[rank], bounds[rank + 1]

    def part(name: str, t):
        """This rank's part of an input, output or gradient (dX: that of X)."""
        key = name[1:] if name.startswith("d") else name
        if t is None or key == "cu_seqlens" or (key == "g" and spec.decay == "constant"):
            return t
        if key in ("initial_state", "final_state"):
            return t[starting if key == "initial_state" else ending]
        return t[:, a:b]

    mine = {n: part(n, t) for n, t in inputs.items()}
    if "initial_state" in mine and not starting:
        mine["initial_state"] = None
    cp = ContextParallel(op, group, method=case.method)
    got, _ = _run(lambda **kw: cp(**kw, shard_lengths=lengths), spec, mine,
                  {n: part(n, w) for n, w in weights.items()})
    if "initial_state" in inputs and not starting:
        got["dinitial_state"] = want["dinitial_state"][:0]
    if spec.decay == "constant":
        dist.all_reduce(got["dg"], group=group)    # g [H] is every rank's: its gradient sums theirs
    rows = {}
    for name, ref in want.items():
        ref = part(name, ref)
        if tuple(got[name].shape) != tuple(ref.shape):
            rows[name] = [float("inf"), 0.0, f"shape {tuple(got[name].shape)}, expected {tuple(ref.shape)}"]
            continue
        tol = FLOAT64_RTOL if lowp is None else tolerance(dtype, rel_error(part(name, lowp[name]), ref))
        rows[name] = [rel_error(got[name], ref), tol]
    return rows


# Bad calls, each raising on every rank before any collective (a rank that went on would wait
# for the others), and the ValueError's message on each rank (a fragment). Shards of 5 and 7 tokens.
BAD_CALLS = {
    "shard_lengths count": (dict(shard_lengths=[5, 7, 1]), ["shard_lengths: expected 2 positive integers"] * 2),
    "shard_lengths entry": (dict(shard_lengths=[6, 6]), ["shard_lengths: entry 0 is 6, but this rank's q holds "
                                                         "T_r = 5", "entry 1 is 6, but this rank's q holds T_r = 7"]),
    # rank 0 holds the starts of the 2 sequences; rank 1 none
    "initial_state": (dict(initial_state=True), ["initial_state: expected [N_r, H, F, V] = [2, 2, 8, 6]",
                                                 "initial_state: no sequence starts in rank 1's shard"]),
    "cu_seqlens total": (dict(cu_seqlens=[0, 3, 11]), ["cu_seqlens: expected strictly increasing offsets from 0 "
                                                       "to the shards' total 12"] * 2),
    "cu_seqlens batch": (dict(cu_seqlens=[0, 3, 12], batch=2),
                         ["cu_seqlens: packed sequences need batch size 1"] * 2),
    # v, g with 4 value heads on q, k with 2
    "grouped value heads": (dict(value_heads=True), ["v: 4 value heads on 2 query / key heads (grouped value heads) "
                                                     "are not supported by context parallelism"] * 2),
}


def bad_call_messages(rank: int, group) -> dict[str, str]:
    """The message each BAD_CALLS entry raises on this rank (mamba2, PyTorch forms)."""
    os.environ["ATTNGEN_BACKEND"] = "torch"
    cp = ContextParallel(attngen.load(REPO / "specs" / "mamba2.yaml"), group)
    out = {}
    for what, (kw, _) in BAD_CALLS.items():
        kw = dict(kw)
        B, T = kw.pop("batch", 2 if "cu_seqlens" not in kw else 1), (5, 7)[rank]
        x = torch.randn(B, T, 2, 8, dtype=torch.float64)
        g = -torch.rand(B, T, 2, dtype=torch.float64)
        s0 = torch.zeros(B + 1 - rank, 2, 8, 6, dtype=torch.float64) if kw.pop("initial_state", False) else None
        v = x[..., :6]
        if kw.pop("value_heads", False):
            v, g = v.repeat_interleave(2, 2), g.repeat_interleave(2, 2)
        if "cu_seqlens" in kw:
            kw["cu_seqlens"] = torch.tensor(kw["cu_seqlens"])
            kw.setdefault("shard_lengths", [5, 7])
        try:
            cp(x, x, v, g, initial_state=s0, **kw)
            out[what] = "no error"
        except ValueError as e:
            out[what] = str(e)
    return out


# A NaN in one packed sequence reaches no other sequence (DESIGN.md §3) under context
# parallelism: per method, 4 ranks, the layout's sequences 1 (from rank 0 into rank 1) and 2 (from
# rank 1 through rank 2) poisoned in turn at their first token.
ISOLATION = ("gated_deltanet", "mamba2", "linear_bidirectional", "forgetting_attention")


def isolation(spec_name: str, rank: int, ranks: int, group) -> dict[str, list[str]]:
    """{poisoned sequence: outputs or gradients that differ from the clean run outside it}."""
    os.environ["ATTNGEN_BACKEND"] = "torch"
    spec = load_spec(REPO / "specs" / f"{spec_name}.yaml")
    cp = ContextParallel(attngen.load(spec), group)
    lengths, cu = layout(random.Random(7), ranks, packed=True)
    bounds = [sum(lengths[:j]) for j in range(ranks + 1)]
    a, b = bounds[rank], bounds[rank + 1]
    inputs = random_inputs(spec, Shape(1, bounds[-1], 2, 8, 6, cu_seqlens=cu), seed=7)
    starting, ending = _rows(cu, bounds, rank, ranks, 1)
    mine = {n: t if n == "cu_seqlens" else t[starting] if n == "initial_state" else t[:, a:b]
            for n, t in inputs.items()}
    if "initial_state" in mine and not starting:
        mine["initial_state"] = None
    run = lambda x: _run(lambda **kw: cp(**kw, shard_lengths=lengths), spec, x, None)[0]
    clean = run(mine)
    out = {}
    for seq in (1, 2):
        lo, hi = max(cu[seq], a) - a, min(cu[seq + 1], b) - a     # its tokens in this shard (maybe none)
        bad = dict(mine)
        for name in ("q", "k", "v"):
            if a <= cu[seq] < b:
                bad[name] = mine[name].clone()
                bad[name][0, cu[seq] - a] = float("nan")
        got = run(bad)
        differ = []
        for name, want in clean.items():
            t = got[name]
            if name in ("final_state", "dinitial_state"):
                rows = ending if name == "final_state" else starting
                keep = [i for i, n in enumerate(rows) if n != seq]
                t, want = t[keep], want[keep]
            elif lo < hi:
                t, want = torch.cat([t[:, :lo], t[:, hi:]], 1), torch.cat([want[:, :lo], want[:, hi:]], 1)
            if not torch.equal(t, want):
                differ.append(name)
        out[str(seq)] = differ
    return out


def _worker(rank: int, ranks: int, init_file: str, out_dir: str, cases: list[Case], train: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=ranks,
                            timeout=datetime.timedelta(seconds=120))
    group = dist.new_group(list(range(ranks)))
    results = {}
    for case in cases:
        try:
            results[case.id] = run_case(case, rank, ranks, group)
        except Exception:  # noqa: BLE001 - reported by the test of the case
            results[case.id] = {"error": traceback.format_exc()}
    if ranks == 4:
        for name in ISOLATION:
            try:
                results[f"isolation {name}"] = isolation(name, rank, ranks, group)
            except Exception:  # noqa: BLE001
                results[f"isolation {name}"] = {"error": traceback.format_exc()}
    if train:
        results["bad calls"] = bad_call_messages(rank, group)
        from training import train_context_parallel
        try:
            results["train"] = train_context_parallel(group)
            if rank == 0:
                results["train_one_process"] = train_context_parallel(None)
        except Exception:  # noqa: BLE001
            results["train"] = {"error": traceback.format_exc()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def _launch(ranks: int, tmp: Path, train: bool) -> list[dict]:
    mp.start_processes(_worker, args=(ranks, str(tmp / "init"), str(tmp), CASES[ranks], train), nprocs=ranks,
                       start_method="fork")
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(ranks)]


@pytest.fixture(scope="module")
def ranks2(tmp_path_factory):
    return _launch(2, tmp_path_factory.mktemp("cp2"), train=True)


@pytest.fixture(scope="module")
def ranks4(tmp_path_factory):
    return _launch(4, tmp_path_factory.mktemp("cp4"), train=False)


def _check(results: list[dict], case: Case) -> None:
    failures = []
    for rank, rows in enumerate(results):
        got = rows[case.id]
        if "error" in got:
            failures.append(f"rank {rank}: {got['error']}")
            continue
        for name, (err, tol, *why) in got.items():
            if not err <= tol:
                failures.append(f"rank {rank} {name}: error {err:.3g} > {tol:.3g} {' '.join(why)}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("case", CASES[2], ids=lambda c: c.id)
def test_two_ranks(ranks2, case):
    _check(ranks2, case)


@pytest.mark.parametrize("case", CASES[4], ids=lambda c: c.id)
def test_four_ranks(ranks4, case):
    _check(ranks4, case)


def test_ddp_and_context_parallel_training_equals_one_process(ranks2):
    assert "error" not in ranks2[0]["train"], ranks2[0]["train"]["error"]
    want = ranks2[0]["train_one_process"]
    assert want[-1] < want[0], want
    for rank, rows in enumerate(ranks2):
        got = rows["train"]
        assert "error" not in got, got["error"]
        assert len(got) == len(want)
        assert max(abs(x - y) / abs(y) for x, y in zip(got, want)) < 1e-9, (rank, got, want)


@pytest.mark.parametrize("what", BAD_CALLS)
def test_bad_calls_raise_value_errors_naming_the_argument(ranks2, what):
    for rank, expected in enumerate(BAD_CALLS[what][1]):
        assert expected in ranks2[rank]["bad calls"][what], (rank, ranks2[rank]["bad calls"][what])


def test_method_is_the_planners_and_checked():
    """The planner picks the method from the spec; asking for an illegal one is a ValueError."""
    methods = {name: attngen.distributed.ContextParallel(attngen.load(REPO / "specs" / f"{name}.yaml")).parallel.method
               for name in SPECS}
    assert methods == {name: "keys" if not load_spec(REPO / "specs" / f"{name}.yaml").is_linear else
                       "sum" if "bidirectional" in name else
                       "affine" if name in ("deltanet", "gated_deltanet", "kda") else "decay" for name in SPECS}
    with pytest.raises(ValueError, match="method: 'decay' is not a context-parallel method of spec "
                                         "'gated_deltanet'; legal: affine"):
        ContextParallel(attngen.load(REPO / "specs" / "gated_deltanet.yaml"), method="decay")


def test_call_without_a_process_group_is_a_value_error():
    cp = ContextParallel(attngen.load(REPO / "specs" / "mamba2.yaml"))
    x = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        cp(x, x, x, -torch.rand(1, 4, 2))


def test_explain_ranks_shows_the_exchange_and_bytes_per_rank(capsys):
    from attngen.cli import main
    assert main(["explain", "specs/gated_deltanet.yaml", "--ranks", "4", "--shape", "1,4096,16,128,128"]) == 0
    out = capsys.readouterr().out
    assert "context parallel over 4 ranks (attngen.distributed), B=1, shards of 1024 tokens: method affine" in out
    # [M | S_loc]: 16 heads x 128 x (128 + 128) float32 = 2 MiB from each rank, 3 ranks' worth received
    assert "[M | S_loc] (524288 values of 4 bytes)" in out
    assert "contributes 2.00 MiB and receives 6.00 MiB forward, the same backward" in out
    assert main(["explain", "specs/softmax_causal.yaml", "--ranks", "2", "--shape", "1,4096,16,128,128"]) == 0
    out = capsys.readouterr().out
    # k and v of a 2048-token shard, bf16: 2 x 2048 x 16 x 128 x 2 bytes
    assert "method keys" in out and "contributes 16.00 MiB and receives 16.00 MiB" in out


def test_explain_ranks_past_the_tokens_is_an_error(capsys):
    """More ranks than tokens would leave ranks without a shard: a clear error before any output."""
    from attngen.cli import main
    assert main(["explain", "specs/gated_deltanet.yaml", "--ranks", "9", "--shape", "1,8,2,16,16"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "--ranks: 9 ranks over T=8 tokens" in err and "at most 8" in err
    assert main(["explain", "specs/gated_deltanet.yaml", "--ranks", "8", "--shape", "1,8,2,16,16"]) == 0
    assert "shards of 1 tokens" in capsys.readouterr().out
    # argparse names the argument once
    with pytest.raises(SystemExit):
        main(["explain", "specs/gated_deltanet.yaml", "--ranks", "0"])
    err = capsys.readouterr().err
    assert "argument --ranks: expected a positive integer, got '0'" in err and err.count("--ranks:") == 1


@pytest.mark.parametrize("spec_name", ISOLATION)
def test_a_nan_in_one_packed_sequence_reaches_no_other(ranks4, spec_name):
    for rank, rows in enumerate(ranks4):
        got = rows[f"isolation {spec_name}"]
        assert "error" not in got, got["error"]
        assert got == {"1": [], "2": []}, (rank, got)
