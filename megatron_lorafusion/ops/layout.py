"""`AdapterLayout`: how the tokens of one packed microbatch are grouped by adapter.

Built once per microbatch (by `data`) and shared by every LoRA layer of the model; the
autograd functions save the layout they ran with, so backward never reads global state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from megatron_lorafusion.ops._utils import copy_to_device


@dataclass(frozen=True, eq=False)
class AdapterLayout:
    """Adapter-major grouping of a packed microbatch of ``T`` tokens.

    Adapter ``a`` owns token rows ``seg_offsets[a]:seg_offsets[a + 1]``; an adapter with no
    tokens in this microbatch has an empty segment. Each segment is a run of whole samples
    (sequences), whose boundaries ``cu_seqlens`` give to varlen attention.

    Attributes:
        seg_offsets: (A + 1,) int64 on CPU, token offset of each adapter's segment.
        cu_seqlens: (S + 1,) int32 on the compute device, token offset of each sample.
        max_seqlen: longest sample, in tokens.
        dropout_seed: seed of the dropout masks (a training job's ``train.seed``); layers mix
            in their own id (`_utils.mixed_seed`).
        row_keys: (T,) int64 on the compute device, the dropout key of each token row: with
            the layer's seed and the column it keys that element's draw (`_utils.keep_mask_tile`).
            A job gives each row ``key(adapter, sample) + position in the sample``, so a token's
            mask depends on what it is, never on the microbatch it lands in (DESIGN.md "Every
            adapter on its own"); by default row ``t`` of the microbatch has key ``t``. A
            `shard` keeps its rows' keys, so its masks are the rows of the unsharded ones.
    """

    seg_offsets: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    dropout_seed: int = 0
    row_keys: torch.Tensor | None = None
    _cache: dict = field(default_factory=dict, init=False, repr=False)  # derived, host and device

    @classmethod
    def from_samples(
        cls,
        sample_adapters: Sequence[int],
        sample_lengths: Sequence[int],
        num_adapters: int,
        device: torch.device | str = "cpu",
        dropout_seed: int = 0,
        sample_keys: Sequence[int] | None = None,
    ) -> AdapterLayout:
        """Build the layout of samples already ordered adapter-major.

        Args:
            sample_adapters: adapter id of each sample, non-decreasing.
            sample_lengths: token count of each sample (> 0).
            num_adapters: ``A``, the number of adapters in the run.
            device: where ``cu_seqlens`` and ``row_keys`` live (the model's device).
            dropout_seed: seed of the dropout masks (layers mix in their own id).
            sample_keys: per sample, its dropout key (taken mod ``2**62``; row ``i`` of a sample
                gets ``key + i``); None: row ``t`` of the microbatch gets key ``t``.

        Raises:
            ValueError: on unordered adapters, ids outside ``[0, A)`` or empty samples.
        """
        if len(sample_adapters) != len(sample_lengths):
            raise ValueError(
                f"sample_adapters has {len(sample_adapters)} entries, "
                f"sample_lengths has {len(sample_lengths)}"
            )
        if any(b < a for a, b in zip(sample_adapters, sample_adapters[1:], strict=False)):
            raise ValueError(f"samples must be ordered adapter-major, got {list(sample_adapters)}")
        if any(not 0 <= a < num_adapters for a in sample_adapters):
            raise ValueError(f"adapter ids must lie in [0, {num_adapters}), got {sample_adapters}")
        if any(n <= 0 for n in sample_lengths):
            raise ValueError(f"sample lengths must be positive, got {list(sample_lengths)}")
        if sample_keys is not None and len(sample_keys) != len(sample_lengths):
            raise ValueError(
                f"sample_keys has {len(sample_keys)} entries, sample_lengths {len(sample_lengths)}"
            )
        counts = [0] * num_adapters
        for a, n in zip(sample_adapters, sample_lengths, strict=True):
            counts[a] += n
        seg_offsets = torch.zeros(num_adapters + 1, dtype=torch.int64)
        seg_offsets[1:] = torch.cumsum(torch.tensor(counts, dtype=torch.int64), 0)
        cu_seqlens = torch.zeros(len(sample_lengths) + 1, dtype=torch.int32)
        cu_seqlens[1:] = torch.cumsum(torch.tensor(list(sample_lengths), dtype=torch.int32), 0)
        total = int(seg_offsets[-1])
        if sample_keys is None:
            row_keys = torch.arange(total, dtype=torch.int64)
        else:  # (T,) key of the row's sample + the row's position in its sample
            lengths = torch.tensor(list(sample_lengths), dtype=torch.int64)
            keys = torch.tensor([k % 2**62 for k in sample_keys], dtype=torch.int64)
            starts = torch.repeat_interleave(cu_seqlens[:-1].to(torch.int64), lengths)
            row_keys = torch.repeat_interleave(keys, lengths) + (torch.arange(total) - starts)
        return cls(
            seg_offsets=seg_offsets,
            cu_seqlens=copy_to_device(cu_seqlens, device),
            max_seqlen=max(sample_lengths, default=0),
            dropout_seed=dropout_seed,
            row_keys=copy_to_device(row_keys, device),
        )

    def shard(self, start: int, end: int) -> AdapterLayout:
        """The layout of token rows ``start:end`` (a sequence-parallel rank's share).

        Segments and samples are clipped to the range; the rows keep their dropout keys, so
        masks match the rows of the whole microbatch.

        Raises:
            ValueError: when ``0 <= start <= end <= T`` does not hold.
        """
        if not 0 <= start <= end <= self.num_tokens:
            raise ValueError(f"shard rows [{start}, {end}) must lie in [0, {self.num_tokens}]")
        seg_offsets = self.seg_offsets.clamp(start, end) - start
        bounds = self.cu_seqlens.cpu().to(torch.int64).clamp(start, end) - start
        bounds = torch.unique_consecutive(bounds)
        if bounds[0] != 0:
            bounds = torch.cat([bounds.new_zeros(1), bounds])
        return AdapterLayout(
            seg_offsets=seg_offsets,
            cu_seqlens=bounds.to(torch.int32).to(self.cu_seqlens.device),
            max_seqlen=int(torch.diff(bounds).max()) if bounds.numel() > 1 else 0,
            dropout_seed=self.dropout_seed,
            row_keys=self.keys()[start:end],
        )

    def keys(self) -> torch.Tensor:
        """(T,) int64 `row_keys` (row ``t``: key ``t`` when the layout was built without them)."""
        if self.row_keys is not None:
            return self.row_keys
        if "keys" not in self._cache:
            self._cache["keys"] = torch.arange(self.num_tokens, device=self.cu_seqlens.device)
        return self._cache["keys"]

    @property
    def num_adapters(self) -> int:
        """``A``, adapters in the run (including those with no tokens here)."""
        return self.seg_offsets.numel() - 1

    @property
    def num_tokens(self) -> int:
        """``T``, tokens in the microbatch (cached: every launcher checks it)."""
        if "num_tokens" not in self._cache:
            self._cache["num_tokens"] = int(self.seg_offsets[-1])
        return self._cache["num_tokens"]

    def token_counts(self) -> list[int]:
        """Tokens of each adapter in this microbatch, a list of ``A`` ints (cached)."""
        if "token_counts" not in self._cache:
            self._cache["token_counts"] = tuple(torch.diff(self.seg_offsets).tolist())
        return list(self._cache["token_counts"])

    def segments(self) -> list[tuple[int, int, int]]:
        """``(adapter, start, end)`` for each adapter with at least one token."""
        offsets = self.seg_offsets.tolist()
        return [
            (a, offsets[a], offsets[a + 1])
            for a in range(self.num_adapters)
            if offsets[a + 1] > offsets[a]
        ]

    def present_ids(self) -> tuple[int, ...]:
        """Ids of the adapters with at least one token here, in order (cached)."""
        if "present_ids" not in self._cache:
            counts = self.token_counts()
            self._cache["present_ids"] = tuple(a for a, n in enumerate(counts) if n)
        return self._cache["present_ids"]

    def present(self, device: torch.device | str) -> torch.Tensor:
        """(k,) int64 `present_ids` on ``device``, cached per device."""
        key = ("present", str(device))
        if key not in self._cache:
            ids = torch.tensor(self.present_ids(), dtype=torch.int64)
            self._cache[key] = copy_to_device(ids, device)
        return self._cache[key]

    def row_adapter(self, device: torch.device | str) -> torch.Tensor:
        """(T,) int64 adapter id of each token row, cached per device."""
        key = ("row_adapter", str(device))
        if key not in self._cache:
            counts = torch.diff(self.seg_offsets)
            rows = torch.repeat_interleave(torch.arange(self.num_adapters), counts)
            self._cache[key] = copy_to_device(rows, device)
        return self._cache[key]

    def tiles(self, block: int, device: torch.device | str) -> torch.Tensor:
        """(n_tiles, 3) int32 ``(adapter, row_start, row_end)`` tiles of at most ``block`` rows.

        Each adapter's segment is cut into ``ceil(T_a / block)`` tiles, so every tile belongs
        to one adapter (the kernels read that adapter's A, B, scale and dropout); empty
        adapters get no tile. There are at most ``T / block + A`` tiles. Cached per
        ``(block, device)``.

        Raises:
            ValueError: when ``block`` is not positive.
        """
        if block <= 0:
            raise ValueError(f"tile height must be positive, got block={block}")
        key = ("tiles", block, str(device))
        if key not in self._cache:
            rows = []
            for adapter, start, end in self.segments():
                for row in range(start, end, block):
                    rows.append((adapter, row, min(row + block, end)))
            table = torch.tensor(rows, dtype=torch.int32).reshape(-1, 3)
            self._cache[key] = copy_to_device(table, device)
        return self._cache[key]

    def tile_ranges(self, block: int, device: torch.device | str) -> torch.Tensor:
        """(A + 1,) int32 offsets of each adapter's tiles in `tiles` (``block`` rows), cached."""
        key = ("tile_ranges", block, str(device))
        if key not in self._cache:
            counts = (torch.diff(self.seg_offsets) + block - 1) // block
            offsets = torch.zeros(self.num_adapters + 1, dtype=torch.int32)
            offsets[1:] = torch.cumsum(counts, 0)
            self._cache[key] = copy_to_device(offsets, device)
        return self._cache[key]
