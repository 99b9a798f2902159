"""A small training task for smoke tests: a 2-layer model whose token mixers are generated
ops learns to recall the token seen LAG steps earlier. Used on the CPU (PyTorch forms) and
on the GPU (kernels) so that the two loss curves can be compared."""
from __future__ import annotations

import torch
from torch import nn

from attngen.runtime import Op, load

VOCAB, LAG = 16, 3


class MixerLayer(nn.Module):
    def __init__(self, op: Op, dim: int, heads: int):
        super().__init__()
        self.op, self.heads = op, heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.gate = nn.Linear(dim, heads) if op.spec.decay in ("scalar", "vector") or op.spec.update == "delta" else None
        self.out = nn.Linear(dim, dim, bias=False)
        self.norm = nn.LayerNorm(dim)
        if op.spec.decay == "constant":
            self.register_buffer("g_const", -torch.linspace(0.05, 0.5, heads))

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.norm(x)).view(B, T, 3, self.heads, D // self.heads).unbind(2)
        kw = {}
        spec = self.op.spec
        if spec.decay == "scalar":
            kw["g"] = nn.functional.logsigmoid(self.gate(x) + 3.0)
        elif spec.decay == "vector":
            kw["g"] = nn.functional.logsigmoid(self.gate(x) + 3.0)[..., None].expand(B, T, self.heads, D // self.heads)
        elif spec.decay == "constant":
            kw["g"] = self.g_const
        if spec.update == "delta":
            kw["beta"] = torch.sigmoid(self.gate(x))
        if spec.is_linear:
            o, _ = self.op(q, k, v, **kw)
        else:
            o = self.op(q, k, v, **kw)
        return x + self.out(o.reshape(B, T, D))


class Model(nn.Module):
    def __init__(self, op: Op, dim: int = 32, heads: int = 2, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(MixerLayer(op, dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def batch(gen: torch.Generator, size: int, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (size, length), generator=gen)
    target = torch.roll(tokens, LAG, 1)
    target[:, :LAG] = -100  # nothing to recall yet
    return tokens.to(device), target.to(device)


def train(spec, steps: int = 120, device="cpu", seed: int = 0, length: int = 32, lr: float = 3e-3) -> list[float]:
    """The loss of each step of a deterministic run (same seed -> same data and weights)."""
    op = load(spec)
    torch.manual_seed(seed)
    model = Model(op).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        tokens, target = batch(gen, 16, length, device)
        loss = nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB), target.reshape(-1), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def train_context_parallel(group, spec="specs/gated_deltanet.yaml", steps: int = 4, seed: int = 0,
                           length: int = 24, lr: float = 0.2) -> list[float]:
    """The loss of each step of training Model in float64 with SGD, in one process (group None)
    or as DistributedDataParallel over the default group with the sequences' time shards on the
    ranks of `group` (attngen.distributed.ContextParallel; the same ranks): the same losses.
    Rank r holds tokens [bounds[r], bounds[r + 1]) of every sequence (uneven shards)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from attngen.distributed import ContextParallel

    op = load(spec)
    torch.manual_seed(seed)
    model = Model(op, dim=16).double()
    net, ranks, tokens_of = model, 1, slice(None)
    if group is not None:
        for layer in model.layers:
            layer.op = ContextParallel(op, group)
        ranks, rank = dist.get_world_size(group), dist.get_rank(group)
        bounds = [0, *(length * (j + 1) // ranks + (1 if j < ranks - 1 else 0) for j in range(ranks))]
        tokens_of = slice(bounds[rank], bounds[rank + 1])
        net = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        tokens, target = batch(gen, 8, length, "cpu")
        logits = net(tokens[:, tokens_of])
        total = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target[:, tokens_of].reshape(-1),
                                            ignore_index=-100, reduction="sum")
        count = int((target != -100).sum())
        opt.zero_grad()
        # DDP averages the ranks' gradients; each rank's holds its tokens' part of the mean loss
        (total * ranks / count).backward()
        opt.step()
        total = total.detach()
        if group is not None:
            dist.all_reduce(total, group=group)
        losses.append(total.item() / count)
    return losses
