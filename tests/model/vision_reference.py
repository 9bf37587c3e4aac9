"""MoonViT-V2 and its projector written out from the report (§2.4) and the release's config and tensor names
(checkpoint-layout.md §2.8 and §3), independently of k3.model.vision and k3.ops.

`reference_image_tokens(state_dict, vision_config, images)` takes the vision tensors under their official names
(`vision_tower.*`, `mm_projector.*`), the release's `vision_config` keys and a list of [3, H, W] images, and returns
per image the [(H/28)*(W/28), text_hidden_size] token embeddings the language model receives. It computes in
float64 with plain tensor arithmetic, one image at a time:

1. native-resolution patching: the image is cut into p x p patches (p = patch_size = 14) in raster order (row by
   row, left to right), each flattened channel-major, and multiplied by the patch-embedding weight reshaped to
   [C, 3 p p] (a stride-p, bias-free convolution is exactly this product);
2. the 2-D position scheme ("divided_fixed"): a learned [64, 64, C] table, indexed [row, column], resized with
   bilinear interpolation (align_corners=False: pixel centres, edges clamped) to the image's h x w patch grid
   and added per patch; at the table's own size it is the table;
3. vt_num_hidden_layers pre-norm blocks (RMSNorm, no biases): x += Wo attn(RMS(x) * norm0); x += fc1 act(fc0
   (RMS(x) * norm1)), attention per head as softmax(Q K^T / sqrt(d)) V over all patches of the image and no others
   (bidirectional, no rotary positions), wqkv's rows laid out [q | k | v], each [heads, head_dim];
   act = gelu with the tanh approximation (`activation_func: gelu_pytorch_tanh`); then a final RMSNorm;
4. the 2 x 2 pixel shuffle ("sd2"; temporal pooling is the identity for one frame): merged token (i, j), in raster
   order of the (h/2) x (w/2) grid, is the concatenation of patches (2i, 2j), (2i, 2j+1), (2i+1, 2j), (2i+1, 2j+1);
5. the projector ("patchmergerv2"): Linear(4C -> 4C), exact gelu (`projector_hidden_act: gelu`),
   Linear(4C -> text_hidden_size), then RMSNorm in the LM width (eps projector_ln_eps).

The ViT's own RMSNorms use eps 1e-5 (the release's rms_norm_eps; vision_config has no key for it).
"""

from __future__ import annotations

import math

import torch

VIT_EPS = 1e-5


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _gelu_erf(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


_ACT = {"gelu": _gelu_erf, "gelu_pytorch_tanh": _gelu_tanh, "gelu_tanh": _gelu_tanh}


def patchify(image: torch.Tensor, p: int) -> torch.Tensor:
    """[3, H, W] -> [h * w, 3 * p * p]: patch (r, c) at row r * w + c, its pixels in (channel, y, x) order."""
    c, H, W = image.shape
    h, w = H // p, W // p
    rows = []
    for r in range(h):
        for col in range(w):
            rows.append(image[:, r * p:(r + 1) * p, col * p:(col + 1) * p].reshape(-1))
    return torch.stack(rows)


def _linear_weights(n_out: int, n_in: int) -> list[tuple[int, int, float, float]]:
    """Bilinear resize along one axis, align_corners=False: output index i samples the input at
    (i + 0.5) * n_in / n_out - 0.5 (clamped at 0), between its floor and the next index (clamped at the end).
    Returns (i0, i1, weight of i0, weight of i1) per output index."""
    out = []
    for i in range(n_out):
        src = max((i + 0.5) * n_in / n_out - 0.5, 0.0)
        i0 = int(math.floor(src))
        i1 = min(i0 + 1, n_in - 1)
        lam = src - i0
        out.append((i0, i1, 1.0 - lam, lam))
    return out


def position_table(table: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The learned [H0, W0, C] table at an h x w patch grid: [h, w, C]."""
    H0, W0, C = table.shape
    if (h, w) == (H0, W0):
        return table
    out = torch.zeros(h, w, C, dtype=table.dtype)
    ys, xs = _linear_weights(h, H0), _linear_weights(w, W0)
    for r, (y0, y1, wy0, wy1) in enumerate(ys):
        for c, (x0, x1, wx0, wx1) in enumerate(xs):
            out[r, c] = (wy0 * (wx0 * table[y0, x0] + wx1 * table[y0, x1])
                         + wy1 * (wx0 * table[y1, x0] + wx1 * table[y1, x1]))
    return out


def _attention(x: torch.Tensor, wqkv: torch.Tensor, wo: torch.Tensor, heads: int) -> torch.Tensor:
    qkv = x @ wqkv.T  # [L, 3Q]
    Q = qkv.shape[1] // 3
    d = Q // heads
    q, k, v = qkv[:, :Q], qkv[:, Q:2 * Q], qkv[:, 2 * Q:]
    outs = []
    for hd in range(heads):
        sl = slice(hd * d, (hd + 1) * d)
        s = q[:, sl] @ k[:, sl].T / math.sqrt(d)  # [L, L], every patch sees every patch of its image
        a = torch.exp(s - s.max(-1, keepdim=True).values)
        a = a / a.sum(-1, keepdim=True)
        outs.append(a @ v[:, sl])
    return torch.cat(outs, -1) @ wo.T


def pixel_shuffle_2x2(x: torch.Tensor, h: int, w: int, kh: int = 2, kw: int = 2) -> torch.Tensor:
    """[h * w, C] in raster order -> [(h/kh) * (w/kw), kh * kw * C]: window (i, j) in raster order, its patches
    in raster order within the window, concatenated."""
    grid = x.view(h, w, -1)
    tokens = []
    for i in range(h // kh):
        for j in range(w // kw):
            tokens.append(torch.cat([grid[i * kh + a, j * kw + b] for a in range(kh) for b in range(kw)]))
    return torch.stack(tokens)


def reference_image_tokens(sd: dict[str, torch.Tensor], vision_config: dict,
                           images: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per image its LM-width token embeddings [(H/28)*(W/28), text_hidden_size] in float64 (see the module
    docstring). `sd` holds the official names; `vision_config` the release's keys."""
    vc = vision_config
    p, heads, L = vc["patch_size"], vc["vt_num_attention_heads"], vc["vt_num_hidden_layers"]
    kh, kw = vc["merge_kernel_size"]
    act, proj_act = _ACT[vc["activation_func"]], _ACT[vc["projector_hidden_act"]]
    W = {k: v.double() for k, v in sd.items() if k.startswith(("vision_tower.", "mm_projector."))}
    V = "vision_tower."
    conv = W[V + "patch_embed.proj.weight"]  # [C, 3, p, p]
    C = conv.shape[0]
    out = []
    for image in images:
        _, Hpx, Wpx = image.shape
        h, w = Hpx // p, Wpx // p
        x = patchify(image.double(), p) @ conv.reshape(C, -1).T  # [h * w, C]
        x = x + position_table(W[V + "patch_embed.pos_emb.weight"], h, w).reshape(h * w, C)
        for i in range(L):
            b = f"{V}encoder.blocks.{i}."
            x = x + _attention(_rms(x, W[b + "norm0.weight"], VIT_EPS), W[b + "wqkv.weight"], W[b + "wo.weight"],
                               heads)
            y = _rms(x, W[b + "norm1.weight"], VIT_EPS)
            x = x + act(y @ W[b + "mlp.fc0.weight"].T) @ W[b + "mlp.fc1.weight"].T
        x = _rms(x, W[V + "encoder.final_layernorm.weight"], VIT_EPS)
        t = pixel_shuffle_2x2(x, h, w, kh, kw)
        t = proj_act(t @ W["mm_projector.proj.0.weight"].T) @ W["mm_projector.proj.2.weight"].T
        out.append(_rms(t, W["mm_projector.post_norm.weight"], vc["projector_ln_eps"]))
    return out
