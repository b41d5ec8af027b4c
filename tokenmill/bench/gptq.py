"""The per-linear mathematics of tokenmill/bench/quant_checkpoints.py's GPTQ maker: GPTQ (Frantar et
al., 2022) with act-order over static groups whose ranges come from a clipping search, the
least-squares refit of the groups' scales, AWQ's input scales (Lin et al., 2023), the calibration
statistics, and the target compensated toward the full-precision model's outputs (as GPTAQ). torch
only, on the CPU, in float64 where it matters; the maker decides what each linear sees."""

from __future__ import annotations

# Shrink ratios of a group's range tried by the clipping search: a narrower range rounds the bulk of the
# group more finely at the cost of clipping its extremes.
CLIP_SHRINKS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)


def group_range(block, importance, shrinks=CLIP_SHRINKS):
    """Asymmetric 4-bit (scale, zero) [N] of a group of weights [N, G]: of the range [min, max] (widened
    to hold 0, which integer zero points always represent) shrunk by each ratio, the one whose
    round-to-nearest error, each column weighted by importance [G] (the diagonal of X^T X: how strongly
    its input drives the output), is least. Zero points stay in 1..15: GPTQ stores zero - 1 in 4 bits."""
    import torch

    lo, hi = block.amin(1).clamp(max=0), block.amax(1).clamp(min=0)
    best = None
    for ratio in shrinks:
        scale = ((hi - lo) * ratio / 15).clamp(min=1e-8).half().double()  # as the checkpoint stores it
        zero = torch.round(-lo * ratio / scale).clamp(1, 15)
        q = torch.round(block / scale[:, None] + zero[:, None]).clamp(0, 15)
        error = (((q - zero[:, None]) * scale[:, None] - block) ** 2 * importance).sum(1)
        if best is None:
            best = (error, scale, zero)
        else:
            better = error < best[0]
            best = tuple(torch.where(better, new, old) for new, old in zip((error, scale, zero), best))
    return best[1], best[2]


def gptq_quantize(
    weight, hessian, group_size: int, damp: float = 0.01, block_size: int = 128, ranges: tuple | None = None
):
    """GPTQ (Frantar et al., 2022) of one linear weight [N, K] with asymmetric 4-bit groups along K:
    columns are quantized one at a time, each one's rounding error spread over the columns not yet
    quantized through the inverse Hessian of the layer's inputs (H = X^T X). Columns go in order of
    descending H diagonal (act-order: the most influential first, while the most columns remain to
    absorb their error) with each group's range fixed beforehand from the original weights by a
    clipping search ("static groups"), so the checkpoint keeps desc_act false and a plain g_idx.
    ranges: (scale, zero) [G, N] to use instead of the clipping search's.
    Returns (q [N, K] in 0..15, scale [G, N], zero [G, N]) with w ~= (q - zero) * scale."""
    import torch

    w = weight.double().clone()
    n, k = w.shape
    h = hessian.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    importance = torch.diag(h).clone()
    groups = torch.arange(k) // group_size
    if ranges is None:
        found = [group_range(w[:, groups == g], importance[groups == g]) for g in range(int(groups[-1]) + 1)]
        scale, zero = torch.stack([r[0] for r in found]), torch.stack([r[1] for r in found])
    else:
        scale, zero = ranges
    order = torch.argsort(importance, descending=True)
    w, h = w[:, order], h[order][:, order]
    column_scale, column_zero = scale[groups[order]].t(), zero[groups[order]].t()  # [N, K], in order
    h += damp * torch.diag(h).mean() * torch.eye(k, dtype=h.dtype)
    h_inv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros(n, k, dtype=torch.int64)
    for start in range(0, k, block_size):  # lazy batches: the rest of W is updated once per block
        end = min(start + block_size, k)
        block, h_block = w[:, start:end].clone(), h_inv[start:end, start:end]
        errors = torch.zeros_like(block)
        for i in range(end - start):
            s, z = column_scale[:, start + i], column_zero[:, start + i]
            q[:, start + i] = torch.round(block[:, i] / s + z).clamp(0, 15).long()
            errors[:, i] = (block[:, i] - (q[:, start + i] - z) * s) / h_block[i, i]
            block[:, i:] -= errors[:, i, None] * h_block[i, i:][None, :]
        w[:, end:] -= errors @ h_inv[start:end, end:]
    unordered = torch.empty_like(q)
    unordered[:, order] = q
    return unordered, scale, zero


def refit_scales(weight, hessian, q, scale, zero, group_size: int):
    """The groups' scales [G, N] that, with GPTQ's codes q [N, K] and zero points fixed, minimise the
    layer's output error on the calibration inputs, tr((W - W') H (W - W')^T) with W' = (q - zero) *
    scale: a least-squares problem of G unknowns per output row (GPTQ chose the codes column by column;
    the scales were fixed before it). A row whose system is singular, or a scale that comes out not
    positive, keeps the old one."""
    import torch

    w, h = weight.double(), hessian.double()
    n, k = w.shape
    groups = torch.arange(k) // group_size
    count = int(groups[-1]) + 1
    codes = (q - zero[groups].t()).double()  # [N, K]
    a = torch.zeros(n, count, count, dtype=torch.float64)
    for g in range(count):
        rows_g = groups == g
        cross = codes[:, rows_g] @ h[rows_g]  # [N, K]
        for g2 in range(count):
            a[:, g, g2] = (cross[:, groups == g2] * codes[:, groups == g2]).sum(1)
    wh = w @ h
    b = torch.stack([(wh[:, groups == g] * codes[:, groups == g]).sum(1) for g in range(count)], 1)
    ridge = 1e-9 * a.diagonal(dim1=1, dim2=2).mean(1).clamp(min=1e-30)
    a = a + ridge[:, None, None] * torch.eye(count, dtype=torch.float64)
    solved, info = torch.linalg.solve_ex(a, b[:, :, None])
    new = solved[:, :, 0].t()  # [G, N]
    ok = (info == 0)[None, :] & torch.isfinite(new) & (new > 0)
    return torch.where(ok, new, scale.double())


def awq_scales(weights, hessian, mean_abs, grid: int = 20):
    """AWQ (Lin et al., 2023): per-input-channel scales s = mean|x|^alpha (normalised to geometric mean
    1) for linears sharing one input, with alpha in [0, 1) chosen on the calibration data to minimise
    the output error sum((dW H) * dW) of group-128 round-to-nearest applied to W * s (then / s).
    Quantizing W * s on inputs x / s lets the channels with large activations keep more precision."""
    import torch

    w, h = torch.cat(weights).float(), hessian.float()
    best = None
    for step in range(grid):
        s = mean_abs.float().clamp(min=1e-4) ** (step / grid)
        s = s / (s.max() * s.min()).sqrt()
        error = _round_to_nearest(w * s) / s - w
        loss = ((error @ h) * error).sum().item()
        if best is None or loss < best[0]:
            best = (loss, s.double())
    return best[1]


def _round_to_nearest(w, group_size: int = 128):
    """Asymmetric 4-bit round-to-nearest of w [N, K] in groups along K (the range holding 0)."""
    import torch

    blocks = []
    for block in w.split(group_size, dim=1):
        lo, hi = block.amin(1, keepdim=True).clamp(max=0), block.amax(1, keepdim=True).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        zero = torch.round(-lo / scale).clamp(1, 15)
        blocks.append((torch.round(block / scale + zero).clamp(0, 15) - zero) * scale)
    return torch.cat(blocks, dim=1)


def fold_awq_scales(linears: list, source, hessian, mean_abs):
    """Scale the inputs of `linears` (sharing one input) by AWQ's factors: the weights' columns by s,
    the operation producing the input (`source`: an RMSNorm weight, or up_proj's rows for down_proj) by
    1/s, so the layer computes the same function; returns the Hessian of the scaled inputs."""
    s = awq_scales([m.weight.data for m in linears], hessian, mean_abs)
    for m in linears:
        m.weight.data = (m.weight.data.double() * s).float()
    source.data = (source.data.double() / (s if source.dim() == 1 else s[:, None])).float()
    return hessian / (s[:, None] * s[None, :])


def cross_statistics(reference: list, inputs: list):
    """X^T X~ summed over the tokens: the full-precision model's inputs of a linear (X) against the inputs
    it sees with everything before it quantized (X~), one tensor per calibration sequence each."""
    cross = 0
    for x, y in zip(reference, inputs):
        cross = cross + x.reshape(-1, x.shape[-1]).double().t() @ y.reshape(-1, y.shape[-1]).double()
    return cross


def compensated_target(weight, hessian, cross, blend: float = 1.0, damp: float = 0.01):
    """The weight whose output on the quantized path's inputs X~ best matches the full-precision layer's
    output on its own inputs X: argmin_W' |X W^T - X~ W'^T|^2 = W (X^T X~) (X~^T X~)^-1, written as W plus
    a correction for the inputs' difference, W ((X - X~)^T X~) (X~^T X~)^-1, so that the damping (as
    GPTQ damps its Hessian) shrinks only the correction: damping the whole product would pull W toward
    zero along the directions the calibration rarely excites, even where X = X~. `blend` of the
    correction is added (1: the least-squares weight).
    GPTQ then quantizes this target, so each layer also absorbs the error the layers before it left in
    its inputs (as GPTAQ, Li et al., 2025)."""
    import torch

    h = hessian.double()
    h = h + damp * h.diagonal().mean() * torch.eye(h.shape[0], dtype=h.dtype)
    w = weight.double()
    correction = torch.linalg.solve(h, (cross.double() - hessian.double()).t() @ w.t()).t()
    return (w + blend * correction).float()


def input_statistics(inputs: list) -> tuple:
    """X^T X and |X| summed over the tokens (AWQ needs only each channel's relative size, so a sum
    serves as a mean) of a linear's inputs, one tensor per calibration sequence."""
    hessian = abs_sum = 0
    for x in inputs:
        x = x.reshape(-1, x.shape[-1]).double()
        hessian = hessian + x.t() @ x
        abs_sum = abs_sum + x.abs().sum(0)
    return hessian, abs_sum


def output_error(weight, hessian, q, scale, zero, group_size: int) -> float:
    """The layer's output error on the calibration inputs, tr((W - W') H (W - W')^T)."""
    import torch

    groups = torch.arange(weight.shape[1]) // group_size
    delta = weight.double() - (q - zero[groups].t()) * scale[groups].t()
    return float(((delta @ hessian.double()) * delta).sum())
