"""The recurrent Triton kernel (token loop and decode step) through Triton's interpreter,
against the interpreter of the spec; the kernel op under torch.compile(fullgraph=True)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attngen
from attngen.testing import Shape, compare, random_inputs, rel_error

import specs
from strategies import causal_linear, legal_specs


pytestmark = pytest.mark.usefixtures("triton_backend")


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(legal_specs().filter(causal_linear),
       st.sampled_from([Shape(2, 7, 2, 5, 3), Shape(1, 9, 1, 8, 12), Shape(1, 12, 2, 6, 4, cu_seqlens=(0, 1, 5, 12))]),
       st.sampled_from([torch.float32, torch.bfloat16]), st.booleans())
def test_recurrent_kernel_matches_interpreter(spec_dict, shape, dtype, initial_state):
    op = attngen.load(spec_dict)
    inputs = random_inputs(op.spec, shape, initial_state=initial_state)
    rows = compare(op.spec, lambda **kw: op(**kw, form="recurrent"), inputs, dtype, with_grads=False)
    for name, err, tol in rows:
        assert err <= tol, f"{name}: rel err {err:.2e} > tol {tol:.2e}"


CASES = specs.causal_linear("recurrent")


@pytest.mark.parametrize("name", list(CASES))
def test_decode_steps_equal_one_call(name):
    """T calls of one token, passing the state, equal one call over T tokens."""
    op = attngen.load(CASES[name])
    inputs = random_inputs(op.spec, Shape(2, 6, 2, 8, 5), dtype=torch.float32)
    o_all, s_all = op(**inputs, output_final_state=True, form="recurrent")
    state = inputs.pop("initial_state")
    outs = []
    for t in range(6):
        step = {n: (x[:, t:t + 1] if x.dim() >= 3 else x) for n, x in inputs.items()}
        o_t, state = op(**step, initial_state=state, output_final_state=True)
        outs.append(o_t)
    assert rel_error(torch.cat(outs, 1), o_all) < 1e-5
    assert rel_error(state, s_all) < 1e-5


@pytest.mark.parametrize("name", list(CASES))
def test_outputs_fully_written(name, poison_fresh_buffers):
    """Poison the kernel's output buffers with NaN: every element must be overwritten."""
    op = attngen.load(CASES[name])
    inputs = random_inputs(op.spec, Shape(1, 9, 2, 6, 5, cu_seqlens=(0, 4, 9)), dtype=torch.float32)
    o, s = op(**inputs, output_final_state=True, form="recurrent")
    assert torch.isfinite(o).all() and torch.isfinite(s).all()


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_torch_compile_fullgraph(form):
    """A module calling a generated op compiles with no graph break, forward and backward
    (the backward kernels run as an op of their own)."""
    import torch._functorch.config
    import torch._inductor.config

    # on-disk caches could serve a graph compiled against an older generated module
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        torch._dynamo.reset()
        _compile_and_compare(form)


def _compile_and_compare(form):
    op = attngen.load(CASES["gated_deltanet"])

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, q, k, v, g, beta):
            o, s = op(self.proj(q), k, v, g, beta, output_final_state=True, form=form,
                      chunk_size=16 if form == "chunked" else None)
            return o.square().mean() + s.square().mean()

    layer = Layer()
    inputs = random_inputs(op.spec, Shape(1, 5, 2, 8, 8), dtype=torch.float32, initial_state=False)
    args = [inputs[n] for n in ("q", "k", "v", "g", "beta")]
    compiled = torch.compile(layer, fullgraph=True)
    loss_c = compiled(*args)
    loss_c.backward()
    grad_c = layer.proj.weight.grad.clone()
    layer.proj.weight.grad = None
    loss_e = layer(*args)
    loss_e.backward()
    assert rel_error(loss_c, loss_e) < 1e-6
    assert rel_error(grad_c, layer.proj.weight.grad) < 1e-5
