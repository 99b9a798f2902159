"""Render every legal spec combination into a folder, one module each, to hold a template change to the
generated code: `diff -r` of the folders of two trees shows each module the change moved.

    python bench/render_all.py DIR

The combinations: linear attention's feature maps (identity, elu+1, relu, FAVOR+ with 16 features, an
expression) x qk_norm x update rule x decay x normalizer x mask, softmax's decays x masks, every one the
spec loader accepts; then the shipped specs and the variants of tests/specs.py. No GPU, no Triton
compilation: rendering only (bench/compile_time.py --ptx holds a change to the compiled kernels).
"""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from attngen import load_spec  # noqa: E402
from attngen.codegen import render  # noqa: E402
from attngen.spec import SpecError  # noqa: E402

FAVOR_16 = {"features": 16, "orthogonal": True, "seed": 0}


def combinations():
    """(file stem, spec dict) of every combination of the spec's fields (legal or not)."""
    maps = ["identity", "elu_plus_one", "relu", "favor_plus", {"expr": "log(1 + exp(x))"}]
    for i, (fm, norm, update, decay, normalize, mask) in enumerate(itertools.product(
            maps, ["none", "l2"], ["additive", "delta"], ["none", "constant", "scalar", "vector"], ["none", "sum"],
            ["causal", "bidirectional"])):
        spec = {"name": f"linear_{i}", "attention": "linear", "feature_map": fm, "qk_norm": norm, "update": update,
                "decay": decay, "normalize": normalize, "mask": mask}
        if fm == "favor_plus":
            spec["favor_plus"] = FAVOR_16
        yield spec["name"], spec
    for i, (decay, mask) in enumerate(itertools.product(["none", "scalar"], ["causal", "bidirectional", "sliding_window"])):
        spec = {"name": f"softmax_{i}", "attention": "softmax", "decay": decay, "mask": mask}
        if mask == "sliding_window":
            spec["window"] = 64
        yield spec["name"], spec
    import specs as registry   # tests/specs.py: the shipped specs and the kernel tests' variants
    for name, path in registry.SHIPPED.items():
        yield f"shipped_{name}", path
    for group in sorted(n for n in dir(registry) if n.isupper()):
        table = getattr(registry, group)
        if isinstance(table, dict):
            for key, spec in table.items():
                if isinstance(spec, dict) and "attention" in spec:
                    yield f"tests_{group.lower()}_{key}", spec


def main() -> int:
    if len(sys.argv) != 2:
        sys.exit(__doc__.strip().splitlines()[2].strip())
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    rendered = refused = 0
    for stem, spec in combinations():
        try:
            spec = load_spec(spec)
        except SpecError:
            refused += 1
            continue
        (out / f"{stem}.py").write_text(render(spec))
        rendered += 1
    print(f"{rendered} modules rendered into {out} ({refused} combinations refused by the spec loader)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
