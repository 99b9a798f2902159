"""Memory of the chunked kernels' calls, counted on the CPU by bench/peak_memory.py (the kernels'
host code with every launch a no-op, the profiler's memory records): the peak of a call is the live
set of its busiest step, each buffer released after the last step that reads it."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

import attngen
from attngen import kernel_lib
from attngen.testing import Shape

import specs


def _peak_memory_tool():
    path = Path(__file__).resolve().parents[1] / "bench" / "peak_memory.py"
    module_spec = importlib.util.spec_from_file_location("peak_memory", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def test_the_backward_releases_what_its_later_steps_do_not_read():
    """The peak of one training step's allocations (bench/peak_memory.py: the kernels' host code with
    every launch a no-op) is the live set of the backward's busiest step and no more: the buffers
    that only earlier steps read are released before later steps allocate. bf16, B1 T1024 H2
    K = V = 128 at the default launch (backward chunks of 32 tokens for the delta rule, 64 for Mamba2
    and the Linear Transformer)."""
    tool = _peak_memory_tool()
    B, T, H, D = 1, 1024, 2, 128
    shape = Shape(batch=B, q_len=T, heads=H, head_dim=D, value_dim=D)
    tok16, tok32 = B * T * H * D * 2, B * T * H * D * 4
    states = lambda chunk: (T // chunk) * B * H * D * D * 2  # noqa: E731  [slots, H, F, V] bf16
    # the state-gradient pass's segments (kernel_lib.chunked_state_segments, 64-lane value blocks): their
    # start states' gradients [N, G - 1, H, F, V] float32 and decays or normalizer columns [N, G - 1, H, F]
    G = kernel_lib.chunked_state_segments(B * H * D // 64, T, 64)[0]
    ends = (G - 1) * B * H * (D * D + D) * 4
    # the delta rule's: E and its transitions M [N, G - 1, H, F, F] float32 (32-lane value blocks, 32-token chunks)
    delta_ends = (kernel_lib.chunked_state_segments(B * H * D // 32, T, 32)[0] - 1) * B * H * 2 * D * D * 4
    live = {
        # step 3: h_c and dS, W, the state keys, the queries of step 3, U, dU, the output, (I + A)^-1 rows
        # (the forward's, at its 64-token chunks), Γ_C per chunk (step 4a, which also holds h_c and dS, has
        # dq and dW in place of W, the state keys and the queries; h_c is released before 4b allocates)
        # and the segments' E, M
        "gated_deltanet": 2 * states(32) + 6 * tok16 + B * T * H * 64 * 2 + (T // 32) * B * H * 4 + delta_ends,
        # step 3: h_c, the state keys, Γ_C, dU (float32), the queries of step 3, dS, dv, the output
        "mamba2": 2 * states(64) + (T // 64) * B * H * 4 + 4 * tok16 + tok32 + ends,
        # step 3: h_c and the normalizer's column z_c, the state keys, dU (float32), the queries of step 3
        # and their products with c, dO / n, n, c and its two value blocks' shares, dS and its column dz,
        # dv, the output: the normalizer's columns float32 [chunk slots, H, F] apart from the bf16 states
        "linear_transformer": 2 * states(64) + 3 * (T // 64) * B * H * D * 4 + 5 * tok16 + tok32 + 4 * B * T * H * 4
        + ends,
    }
    with tool.no_launches():
        for name, expected in live.items():
            op = attngen.load(specs.SHIPPED[name])
            peak = tool.peak_of(op, shape, torch.bfloat16)
            assert peak <= expected, f"{name}: peak {peak} B above the live set of its busiest step, {expected} B"


def test_the_forward_releases_what_its_output_pass_does_not_read():
    """Inference (no autograd): the forward's peak is its state pass's live set (the chunk-start
    states, W, the state keys, U, (I + A)^-1's rows, Γ_C, and its segments' E and M, float32); W, the
    keys, (I + A)^-1 and Γ_C go back before the output is allocated. gated_deltanet bf16, B1 T1024 H2
    K = V = 128, 64-token chunks, 64-lane value blocks."""
    tool = _peak_memory_tool()
    B, T, H, D, C = 1, 1024, 2, 128, 64
    shape = Shape(batch=B, q_len=T, heads=H, head_dim=D, value_dim=D)
    ends = (kernel_lib.chunked_state_segments(B * H * D // 64, T, C)[0] - 1) * B * H * 2 * D * D * 4
    states_pass = (T // C) * B * H * D * D * 2 + 3 * B * T * H * D * 2 + B * T * H * C * 2 + (T // C) * B * H * 4 + ends
    with tool.no_launches():
        peak = tool.peak_of(attngen.load(specs.SHIPPED["gated_deltanet"]), shape, torch.bfloat16, bwd=False)
    assert peak <= states_pass, f"forward peak {peak} B above its state pass's live set, {states_pass} B"
