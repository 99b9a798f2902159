"""The ops' arguments are described once (attngen/signature.py): the generated modules' ops
register the schemas it renders, unchanged from before it (pinned below), and the Python def
lines that are written by hand (the runtime's, the input checks') agree with it."""
from __future__ import annotations

import inspect
import re

import pytest
import torch

from attngen import codegen, distributed, inputs, load_spec, runtime, signature
from tests.specs import shipped, stem

# torch.ops.attngen.<name> schemas as they were before signature.py rendered them (the linear op's
# for_backward and its backward's saved and starts since); <hash> stands for the spec's hash
PINNED = {
    "gated_deltanet": [
        "attngen::gated_deltanet_<hash>(Tensor q, Tensor k, Tensor v, Tensor? g, Tensor? beta, Tensor? omega, "
        "Tensor? initial_state, Tensor? cu_seqlens, float scale, str form, SymInt[] launch, bool output_final_state, "
        "bool for_backward=False) -> (Tensor, Tensor, Tensor, Tensor)",
        "attngen::gated_deltanet_<hash>_bwd(Tensor q, Tensor k, Tensor v, Tensor? g, Tensor? beta, Tensor? omega, "
        "Tensor? initial_state, Tensor? cu_seqlens, float scale, str form, SymInt[] launch, Tensor saved, Tensor? starts, "
        "Tensor do, Tensor? dht, bool decay_grad=True) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
        "attngen::gated_deltanet_<hash>_cached(Tensor q, Tensor k, Tensor v, Tensor? g, Tensor? beta, "
        "Tensor? omega, Tensor(a6!) state, Tensor slots, Tensor? cu_seqlens, float scale, str form, "
        "SymInt[] launch) -> Tensor",
        "attngen::gated_deltanet(Tensor q, Tensor k, Tensor v, Tensor? g=None, Tensor? beta=None, "
        "float? scale=None, Tensor? initial_state=None, bool output_final_state=False, Tensor? cu_seqlens=None) "
        "-> (Tensor, Tensor)",
    ],
    "sliding_window": [
        "attngen::sliding_window_<hash>(Tensor q, Tensor k, Tensor v, Tensor? g, Tensor? cu_seqlens, float scale, "
        "SymInt max_len, SymInt[] launch) -> (Tensor, Tensor)",
        "attngen::sliding_window_<hash>_cached(Tensor q, Tensor k, Tensor v, Tensor(a3!) k_cache, "
        "Tensor(a4!) v_cache, Tensor(a5!) kv_lens, Tensor kv_slots, Tensor? cu_seqlens, float scale, "
        "SymInt max_len, SymInt[] launch) -> Tensor",
        "attngen::sliding_window_<hash>_softmax_bwd(Tensor q, Tensor k, Tensor v, Tensor? g, Tensor? cu_seqlens, "
        "float scale, SymInt? max_len, SymInt[] launch, Tensor o, Tensor lse, Tensor do, Tensor? dlse) "
        "-> (Tensor, Tensor, Tensor, Tensor)",
        "attngen::sliding_window(Tensor q, Tensor k, Tensor v, Tensor? g=None, float? scale=None, "
        "Tensor? cu_seqlens=None) -> Tensor",
        "attngen::sliding_window.lse(Tensor q, Tensor k, Tensor v, Tensor? g=None, float? scale=None, "
        "Tensor? cu_seqlens=None, *, bool return_lse) -> (Tensor, Tensor)",
    ],
}


def _registered(spec) -> dict[str, str]:
    """The schemas of the ops the spec's generated module registers, by op suffix ("" the kernel op,
    "contract", "contract.lse"), with the spec's hash as <hash>."""
    codegen.load_module(spec)
    found = {}
    for suffix in ("", "_cached", "_bwd", "_softmax_bwd", "contract"):
        name = spec.name if suffix == "contract" else f"{spec.name}_{spec.hash}{suffix}"
        if not hasattr(torch.ops.attngen, name):
            continue
        packet = getattr(torch.ops.attngen, name)
        for overload in packet.overloads():
            key = suffix if overload == "default" else f"{suffix}.{overload}"
            found[key] = str(getattr(packet, overload)._schema).replace(spec.hash, "<hash>")
    return found


@pytest.mark.parametrize("name", sorted(PINNED))
def test_registered_schemas_are_unchanged(name):
    spec = load_spec(f"specs/{name}.yaml")
    assert sorted(_registered(spec).values()) == sorted(PINNED[name])


def _unaliased(schema: str) -> str:
    # a mutated argument reads Tensor(a6!) in the registered schema
    return re.sub(r"Tensor\(a\d+!\)", "Tensor", schema)


@pytest.mark.parametrize("path", shipped(), ids=stem)
def test_registered_schemas_are_the_signatures(path):
    spec = load_spec(path)
    sig = signature.signatures(spec.attention, spec.decay)
    got = {k: _unaliased(s) for k, s in _registered(spec).items()}
    op = f"attngen::{spec.name}_<hash>"
    want = {
        "": sig.op.schema(op, "(Tensor, Tensor, Tensor, Tensor)" if spec.is_linear else "(Tensor, Tensor)"),
        "contract": sig.contract.schema(f"attngen::{spec.name}", "(Tensor, Tensor)" if spec.is_linear else "Tensor"),
    }
    if spec.is_linear:
        want["_bwd"] = sig.backward.schema(f"{op}_bwd", "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
    else:
        want["_softmax_bwd"] = sig.backward.schema(f"{op}_softmax_bwd", "(Tensor, Tensor, Tensor, Tensor)")
        want["contract.lse"] = sig.contract_lse.schema(f"attngen::{spec.name}.lse", "(Tensor, Tensor)")
    if "_cached" in got:
        want["_cached"] = sig.cached.schema(f"{op}_cached", "Tensor")
    assert got == want


def _params(fn, skip: int) -> list[str]:
    """A function's parameters after the first `skip`, as a def line spells them."""
    out = []
    for p in list(inspect.signature(fn).parameters.values())[skip:]:
        if p.kind is p.KEYWORD_ONLY and "*" not in out:
            out.append("*")
        out.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return out


@pytest.mark.parametrize("fn, skip", [(runtime.Op.__call__, 1), (runtime.Op.kernels, 1),
                                      (distributed.ContextParallel.__call__, 1)])
def test_hand_written_calls_take_the_linear_contract(fn, skip):
    # the op's call takes both families' arguments: the linear contract's, in its order, first
    contract = signature.LINEAR_CONTRACT.params()
    assert _params(fn, skip)[:len(contract)] == contract


def test_input_checks_take_the_contracts():
    assert _params(inputs.check_softmax, 1) == signature.SOFTMAX_CONTRACT.params()
    # the linear check reads every input but the output_final_state flag
    assert _params(inputs.check_linear, 1) == signature.LINEAR_CONTRACT.without("output_final_state").params()


def test_bind_names_every_argument():
    sig = signature.SOFTMAX_CONTRACT
    assert sig.bind(q=1, k=2, v=3, g=None, scale=0.5, cu_seqlens=None) == (1, 2, 3, None, 0.5, None)
    with pytest.raises(ValueError, match=r"values: .*missing \['cu_seqlens'\], not arguments \['beta'\]"):
        sig.bind(q=1, k=2, v=3, g=None, scale=0.5, beta=None)
    with pytest.raises(ValueError, match=r"names: \['beta'\] are not arguments"):
        sig.without("beta")


def test_rendered_lines_fit_and_parse():
    names = signature.LINEAR_BACKWARD.names
    text = signature.wrap("    dq, dk, dv, dg, dbeta, dh0 = backward_op(", names, ")")
    assert all(len(line) <= signature.WIDTH for line in text.splitlines())
    assert len(text.splitlines()) == 2
    assert " ".join(text.split()) == f"dq, dk, dv, dg, dbeta, dh0 = backward_op({', '.join(names)})"
    schema = signature.LINEAR_CONTRACT.schema("{SPEC_NAME}", "(Tensor, Tensor)")
    literal = signature.string("CONTRACT_SCHEMA = ", schema)
    assert all(len(line) <= signature.WIDTH for line in literal.splitlines())
    assert eval(literal.removeprefix("CONTRACT_SCHEMA = "), {"SPEC_NAME": "x"}) == schema.replace("{SPEC_NAME}", "x")
