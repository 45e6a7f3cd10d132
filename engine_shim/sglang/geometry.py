"""`HostGeometry`: SGLang's host KV pool (`HostKVCache`) as the block-major
planes `KVClient.register` takes, over the same memory (never a copy), and
the namespace detail that keeps its pages apart from every other engine's.

A kvsidecar block is one SGLang page. SGLang 0.5.23's host pools keep one
tensor, `kv_buffer`, in one of these layouts (P pages of S tokens, L
layers, H heads of D; MLA rows of one latent of width R):

| pool | layout              | kv_buffer             | planes (each [P, bytes of a page]) |
|------|---------------------|-----------------------|------------------------------------|
| MHA  | `layer_first`       | [2, L, P*S, H, D]     | K of layer 0..L-1, then V: 2L      |
| MHA  | `page_first`        | [2, P*S, L, H, D]     | K, V: 2                            |
| MHA  | `page_first_direct` | [2, P, L, S, H, D]    | K, V: 2                            |
| MHA  | `page_head`         | [2, P, H, S, L, D]    | K, V: 2                            |
| MLA  | `layer_first`       | [L, P*S, 1, R]        | layer 0..L-1: L                    |
| MLA  | `page_first`        | [P*S, L, 1, R]        | 1                                  |
| MLA  | `page_first_direct` | [P, L, S, 1, R]       | 1                                  |

Each plane's per-page chunk is contiguous, so the sidecar's copier moves a
page between the pool and a shm slot in one pass. `layer_first` and
`page_first_direct` happen to give a slot the same bytes (SGLang's flat
page, [2, L, S, H, D]) but in different plane counts, so like every other
pair of layouts they key apart: the layout is part of the namespace.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MHA_DIMS = {"layer_first": 5, "page_first": 5, "page_first_direct": 6, "page_head": 6}
MLA_DIMS = {"layer_first": 4, "page_first": 4, "page_first_direct": 5}


@dataclass(frozen=True)
class RankShard:
    """Which part of the model's KV this process holds (SGLang's storage config)."""

    is_mla: bool
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        for rank, size in (("tp_rank", "tp_size"), ("pp_rank", "pp_size")):
            r, n = getattr(self, rank), getattr(self, size)
            if not (isinstance(r, int) and isinstance(n, int) and 0 <= r < n):
                raise ValueError(f"{rank} {r!r} must be an int in [0, {size} = {n!r})")

    def detail(self, layout: str) -> str:
        """The namespace's layout detail: the engine kind first ("sglang"),
        so no vLLM or HF engine ever shares a block with SGLang; then the
        pool kind and layout; then, for MHA, the TP rank and size (each rank
        holds its own heads). MLA KV is the same on every TP rank: one copy,
        shared by all. Pipeline stages hold different layers: the PP rank."""
        parts = ["sglang", "mla" if self.is_mla else "mha", layout]
        if not self.is_mla:
            parts.append(f"tp{self.tp_rank}of{self.tp_size}")
        if self.pp_size > 1:
            parts.append(f"pp{self.pp_rank}of{self.pp_size}")
        return ":".join(parts)


@dataclass(frozen=True)
class HostGeometry:
    layout: str
    page_size: int
    """Tokens per page: tokens_per_block of the namespace."""
    num_heads: int
    """KV heads of this rank (MHA), 1 for MLA."""
    head_dim: int
    """D (MHA) or the latent width R (MLA)."""
    planes: tuple[torch.Tensor, ...]

    @property
    def num_pages(self) -> int:
        return int(self.planes[0].shape[0])

    @property
    def page_bytes(self) -> int:
        """One page of this rank, all planes."""
        return sum(int(p.shape[1]) * p.element_size() for p in self.planes)

    @classmethod
    def of(cls, kv_buffer: object, layout: str, page_size: int, *, is_mla: bool) -> HostGeometry:
        """The planes of a host pool's `kv_buffer` in `layout`. ValueError,
        saying what differs, for a layout or tensor this module does not know."""
        dims = MLA_DIMS if is_mla else MHA_DIMS
        kind = "MLA" if is_mla else "MHA"
        if layout not in dims:
            raise ValueError(
                f"SGLang's {kind} host layout {layout!r} is not supported by kvsidecar: "
                f"use --hicache-mem-layout {' or '.join(sorted(dims))}"
            )
        if not isinstance(kv_buffer, torch.Tensor):
            raise ValueError(
                f"the host pool's kv_buffer must be one tensor, not {type(kv_buffer).__name__}"
            )
        t = kv_buffer
        if t.dim() != dims[layout] or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(
                f"{kind} {layout} kv_buffer must be a contiguous CPU tensor of "
                f"{dims[layout]} dims, got {t.dtype} {tuple(t.shape)} on {t.device}"
            )
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        planes, heads, dim = (
            _mla_planes(t, layout, page_size) if is_mla else _mha_planes(t, layout, page_size)
        )
        return cls(layout, page_size, heads, dim, tuple(planes))


def _pages(tokens: int, page_size: int) -> int:
    if tokens % page_size or tokens == 0:
        raise ValueError(f"a host pool of {tokens} tokens is not whole pages of {page_size}")
    return tokens // page_size


def _mha_planes(t: torch.Tensor, layout: str, s: int) -> tuple[list[torch.Tensor], int, int]:
    if t.shape[0] != 2:
        raise ValueError(f"MHA kv_buffer must hold K and V first, got {tuple(t.shape)}")
    if layout == "layer_first":
        _, layers, tokens, heads, dim = t.shape
        p = _pages(tokens, s)
        planes = [t[k, layer].view(p, -1) for k in (0, 1) for layer in range(layers)]
    elif layout == "page_first":
        _, tokens, _, heads, dim = t.shape
        p = _pages(tokens, s)
        planes = [t[k].view(p, -1) for k in (0, 1)]
    else:  # [2, P, L, S, H, D] or [2, P, H, S, L, D]: S at axis 3 either way
        if t.shape[3] != s:
            raise ValueError(f"{layout} kv_buffer {tuple(t.shape)} has pages of {t.shape[3]}")
        heads = t.shape[4] if layout == "page_first_direct" else t.shape[2]
        dim = t.shape[5]
        planes = [t[k].view(t.shape[1], -1) for k in (0, 1)]
    return planes, int(heads), int(dim)


def _mla_planes(t: torch.Tensor, layout: str, s: int) -> tuple[list[torch.Tensor], int, int]:
    if t.shape[-2] != 1:
        raise ValueError(f"MLA kv_buffer must hold one latent row a token, got {tuple(t.shape)}")
    width = int(t.shape[-1])
    if layout == "layer_first":
        p = _pages(int(t.shape[1]), s)
        planes = [t[layer].view(p, -1) for layer in range(t.shape[0])]
    elif layout == "page_first":
        planes = [t.view(_pages(int(t.shape[0]), s), -1)]
    else:
        if t.shape[2] != s:
            raise ValueError(f"{layout} kv_buffer {tuple(t.shape)} has pages of {t.shape[2]}")
        planes = [t.view(t.shape[0], -1)]
    return planes, 1, width
