"""compute.fisher.persample and accumulate: the per-layer maths on hand-computed values."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import compute.fisher.persample as ps
from compute.fisher.accumulate import Accumulator, Store

F64 = torch.float64


def t(v) -> torch.Tensor:
    return torch.tensor(v, dtype=F64)


# two rows of a 3 -> 2 linear layer, T = 2 positions each
X = t([[[1, 2, 3], [0, 1, 0]], [[2, 0, 0], [0, 0, 1]]])  # (B=2, T=2, in=3)
G = t([[[1, 0], [2, -1]], [[1, 1], [0, 0]]])  # (B=2, T=2, out=2)
# G_n = sum_t g_{n,t} x_{n,t}^T, by hand
W1 = t([[1, 4, 3], [0, -1, 0]])
W2 = t([[2, 0, 0], [2, 0, 0]])


def test_linear_row_grads_and_conv1d_transpose():
    assert_close(ps.linear_row_grads(x=X, g=G), torch.stack([W1, W2]))
    assert_close(ps.linear_row_grads(x=X, g=G, conv1d=True), torch.stack([W1.T, W2.T]))
    assert_close(ps.linear_grad_sum(x=X, g=G), W1 + W2)
    assert_close(ps.bias_row_grads(g=G), t([[3, -1], [1, 1]]))


def test_linear_row_grads_add_into_a_buffer():
    buf = torch.ones(2, 2, 3, dtype=F64)
    out = ps.linear_row_grads(x=X, g=G, out=buf)
    assert out is buf
    assert_close(buf, torch.stack([W1, W2]) + 1)


@pytest.mark.parametrize("small", [ps.SMALL_BATCHED, 0])  # one batched matmul / row loop
def test_linear_square_sum(small, monkeypatch):
    monkeypatch.setattr(ps, "SMALL_BATCHED", small)
    want = t([[5, 16, 9], [4, 1, 0]])  # W1^2 + W2^2
    assert_close(ps.linear_square_sum(x=X, g=G), want)
    assert_close(ps.linear_square_sum(x=X, g=G, conv1d=True), want.T)


@pytest.mark.parametrize("rows_per_block", [1, 3, 7, 1000])
def test_linear_square_sum_in_cpu_blocks_of_output_rows(rows_per_block, monkeypatch):
    """The row loop a block of output rows at a time (CPU_BLOCK_BYTES; 4 MiB since session 18,
    so a test-sized weight is one block unless the block is made small): every block size gives
    the brute-force sum over rows of each row's squared gradient, the last block partial."""
    monkeypatch.setattr(ps, "SMALL_BATCHED", 0)
    g = torch.Generator().manual_seed(4)
    x, gr = torch.randn(5, 6, 11, generator=g, dtype=F64), torch.randn(5, 6, 17, generator=g, dtype=F64)
    monkeypatch.setattr(ps, "CPU_BLOCK_BYTES", rows_per_block * 11 * 8)
    want = sum(torch.einsum("to,ti->oi", gr[n], x[n]) ** 2 for n in range(5))
    assert_close(ps.linear_square_sum(x=x, g=gr), want)


def test_rank1_rows():
    g = t([[[0, 0], [2, -1]], [[1, 1], [0, 0]]])  # row 0 non-zero at t=1 only, row 1 at t=0
    pos = ps.positions(g)[0]
    assert pos is not None and pos.tolist() == [1, 0]
    # G_0 = [2, -1]^T [0, 1, 0], G_1 = [1, 1]^T [2, 0, 0]
    want = t([[0, 4, 0], [0, 1, 0]]) + t([[4, 0, 0], [4, 0, 0]])
    assert_close(ps.linear_rank1_square_sum(x=X, g=g, pos=pos), want)
    assert_close(ps.linear_square_sum(x=X, g=g, pos=pos), want)
    assert_close(ps.linear_square_sum(x=X, g=g), want)  # the general path agrees
    assert_close(ps.linear_row_grads(x=X, g=g, pos=pos), ps.linear_row_grads(x=X, g=g))
    assert ps.positions(G)[0] is None  # row 0 has two non-zero positions


@pytest.mark.parametrize("conv1d", [False, True])
def test_square_sum_over_each_rows_span_of_non_zero_positions(conv1d, monkeypatch):
    """A gradient zero at each row's first and last positions (the output head over a prompt,
    padding after): `positions` gives each row's span of non-zero positions ([first, last + 1),
    a row with none empty), and the square sum over the spans equals the brute-force sum over
    all positions, in every block size; NaN counts as non-zero; nothing to skip: no spans."""
    monkeypatch.setattr(ps, "SMALL_BATCHED", 0)
    g = torch.Generator().manual_seed(7)
    B, T = 6, 10
    x, gr = torch.randn(B, T, 11, generator=g, dtype=F64), torch.randn(B, T, 17, generator=g, dtype=F64)
    starts, ends = [2, 5, 3, 9, 0, 4], [10, 9, 6, 10, 10, 4]  # row 5: no non-zero position
    for n in range(B):
        gr[n, :starts[n]] = 0
        gr[n, ends[n]:] = 0
    gr[0, 3, :16] = 0  # a position zero but for one value is not zero
    want = sum(torch.einsum("to,ti->oi", gr[n], x[n]) ** 2 for n in range(B))
    single, spans = ps.positions(gr)
    assert single is None and spans is not None
    assert spans.tolist() == [[2, 10], [5, 9], [3, 6], [9, 10], [0, 10], [10, 10]]
    if conv1d:  # a Conv1D's weight is (in, out): the same sum, transposed
        want = want.T
    for rows_per_block in (1, 5, 1000):
        monkeypatch.setattr(ps, "CPU_BLOCK_BYTES", rows_per_block * 17 * 8)
        assert_close(ps.linear_square_sum(x=x, g=gr, conv1d=conv1d, spans=spans), want)
        assert_close(ps.linear_square_sum(x=x, g=gr, conv1d=conv1d), want)
    none = torch.zeros(2, 3, 4, dtype=F64)
    assert_close(ps.linear_square_sum(x=torch.ones(2, 3, 5, dtype=F64), g=none,
                                      spans=torch.tensor([[3, 3], [3, 3]])), torch.zeros(4, 5, dtype=F64))
    gr[1, 0, 0] = float("nan")  # row 1 now reaches position 0
    assert ps.positions(gr)[1].tolist()[1] == [0, 9]
    full = torch.randn(B, T, 17, generator=g, dtype=F64)
    assert ps.positions(full) == (None, None)  # row 0 non-zero at both ends: one scan, no spans


def test_embedding_row_grads_scaled_and_padding():
    ids = torch.tensor([[1, 2, 1]])
    g = t([[[1, 0], [0, 1], [2, 3]]])  # (1, 3, d=2)
    row, vocab, grad = ps.embedding_row_grads(ids=ids, g=g, num_embeddings=4, scale=2.0)
    assert row.tolist() == [0, 0] and vocab.tolist() == [1, 2]
    assert_close(grad, t([[6, 6], [0, 2]]))  # 2 * ([1, 0] + [2, 3]), 2 * [0, 1]
    _, _, grad = ps.embedding_row_grads(ids=ids, g=g, num_embeddings=4, padding_idx=2)
    assert_close(grad, t([[3, 3], [0, 0]]))


def test_embedding_rows_do_not_mix():
    ids = torch.tensor([[0, 1], [1, 1]])
    g = t([[[1], [2]], [[3], [4]]])
    row, vocab, grad = ps.embedding_row_grads(ids=ids, g=g, num_embeddings=3)
    assert list(zip(row.tolist(), vocab.tolist(), strict=True)) == [(0, 0), (0, 1), (1, 1)]
    assert_close(grad, t([[1], [2], [7]]))


def test_affine_row_grads_layer_norm():
    ln = nn.LayerNorm(2, eps=0.0).double()
    x = t([[[1, 3], [5, 1]]])  # normalised: [[-1, 1], [1, -1]]
    g = t([[[1, 2], [3, 4]]])
    out = ps.affine_row_grads(module=ln, params=["weight", "bias"], args=(x,), kwargs={}, g=g)
    assert out is not None
    assert_close(out["weight"], t([[2, -2]]))  # sum_t g * normalised
    assert_close(out["bias"], t([[4, 6]]))  # sum_t g


class SquaredScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(t([1, 2]))

    def forward(self, x):
        return x * self.weight**2


def test_generic_row_grads_by_hand():
    mod = SquaredScale()
    x = t([[[1, 1], [2, 3]], [[1, 0], [0, 1]]])
    g = t([[[1, 1], [1, 0]], [[2, 2], [2, 2]]])
    chunks = list(ps.generic_row_grads(module=mod, params=["weight"], args=(x,), kwargs={}, g=g,
                                       rows_per_chunk=1))
    assert [r for r, _ in chunks] == [slice(0, 1), slice(1, 2)]
    got = torch.cat([c["weight"] for _, c in chunks])
    # d/dw sum g * x * w^2 = 2 w sum_t g x
    assert_close(got, t([[2 * 1 * 3, 2 * 2 * 1], [2 * 1 * 2, 2 * 2 * 2]]))


def test_square_sum_paths(monkeypatch):
    grads = t([[1, -2], [3, 0], [0, 1]])
    want = t([10, 5])
    assert_close(ps.square_sum(grads), want)
    monkeypatch.setattr(ps, "SMALL_BATCHED", 0)
    assert_close(ps.square_sum(grads), want)
    assert_close(ps.square_sum(grads.clone(), in_place=True), want)


def test_shared_parameter_squares_the_sum_of_its_uses_per_group():
    store = Store({"w": torch.Size([2])}, n_groups=2, dtype=F64, device=torch.device("cpu"))
    acc = Accumulator(store, torch.tensor([1, 0, 1]), budget_bytes=1 << 20)
    acc.used([("weight", "w")])
    acc.used([("weight", "w")])  # tied: two module calls use w
    acc.add_row_grads("w", slice(0, 3), t([[1, 0], [2, 1], [0, 1]]))
    acc.use_done("w")
    acc.add_row_grads("w", slice(0, 3), t([[2, 0], [0, 1], [0, 1]]))
    acc.use_done("w")
    acc.finish_pass()
    # per-row sums [3, 0], [2, 2], [0, 2]; group 0 = row 1, group 1 = rows 0 and 2
    assert_close(store.finish()["w"], t([[4, 4], [9, 4]]))


def test_store_groups_no_row_reached_are_zero():
    store = Store({"w": torch.Size([2]), "b": torch.Size([1])}, n_groups=3, dtype=F64,
                  device=torch.device("cpu"))
    acc = Accumulator(store, torch.tensor([2, 2]), budget_bytes=1 << 20)
    acc.used([("weight", "w")])
    acc.add_row_grads("w", slice(0, 2), t([[1, 2], [3, 4]]))
    acc.use_done("w")
    out = store.finish()
    assert_close(out["w"], t([[0, 0], [0, 0], [10, 20]]))
    assert_close(out["b"], torch.zeros(3, 1, dtype=F64))
