"""Write an adapter as a Hugging Face PEFT folder for the matching Llama-style model.

The matching model is the checkpoint's class: ``LlamaForCausalLM``, ``Qwen3ForCausalLM``,
``Gemma3ForCausalLM``, ... (modules ``model.layers.{i}.self_attn.q_proj``, ...), or for a
``Gemma3ForConditionalGeneration`` base its language model's modules
(``model.language_model.layers.{i}...``; ``target_modules`` is then a pattern that matches
those only, not the vision tower's projections of the same names).

Megatron fuses projections that Hugging Face keeps apart; a LoRA on a fused linear is exactly
several LoRAs sharing one ``A``:
- ``linear_qkv`` → ``q_proj``/``k_proj``/``v_proj``: the output rows are grouped per query
  group as ``[q heads of the group | k | v]``, so ``B`` is split group by group;
- ``linear_fc1`` → ``gate_proj``/``up_proj``: rows are ``[gate | up]``;
- ``linear_proj`` → ``o_proj``; ``linear_fc2`` → ``down_proj``.
An adapter with per-projection targets (``q_proj``, ``all-linear``, ...) holds on a fused
linear its blocks stacked (`config.lora_blocks`): block ``j``'s ``A`` is rows ``j·r..(j+1)·r``,
its ``B`` the same rank columns of its projections' rows, every other entry zero; each block
becomes its own PEFT module, so the folder has exactly the keys PEFT writes for those
``target_modules``.

`export_checkpoint` (the ``lorafusion export`` command) writes the adapters of a run this
way (each done adapter's exported weights, each other one's newest complete checkpoint)
and, on request, merges each into the base weights of the Hugging Face checkpoint the run
was trained on (``W + scale·B·A`` per module), written as safetensors.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from megatron_lorafusion.adapter_types import LORA, AdapterType, adapter_type
from megatron_lorafusion.config import (
    PROJECTIONS,
    AdapterConfig,
    JobConfig,
    ModelConfig,
    adapter_scaling,
    attention_head_dim,
    job_from_dict,
    lora_blocks,
)
from megatron_lorafusion.validation import adapter_name_problem

_PEFT = "base_model.model."  # PEFT's prefix of the wrapped model's module names
_LAYERS = "model.layers"
_MULTIMODAL_LAYERS = "model.language_model.layers"  # Gemma3ForConditionalGeneration's text


def _layers(model: ModelConfig) -> str:
    """The module path of the decoder layers in the transformers model ``model`` exports to."""
    return _MULTIMODAL_LAYERS if model.hf_multimodal else _LAYERS


_HF_BLOCK = {
    "linear_qkv": "self_attn",
    "linear_proj": "self_attn",
    "linear_fc1": "mlp",
    "linear_fc2": "mlp",
}


def _split_b(module: str, lora_b: torch.Tensor, model: ModelConfig) -> list[torch.Tensor]:
    """Rows of a fused module's ``B`` (N, r), one block per Hugging Face module."""
    if module == "linear_qkv":
        head_dim = attention_head_dim(model)
        per_group = model.num_attention_heads // model.num_query_groups
        grouped = lora_b.reshape(model.num_query_groups, (per_group + 2) * head_dim, -1)
        q, k, v = grouped.split([per_group * head_dim, head_dim, head_dim], dim=1)
        return [t.reshape(-1, lora_b.shape[1]) for t in (q, k, v)]  # (out, r) each
    if module == "linear_fc1":
        return list(lora_b.split(model.ffn_hidden_size, dim=0))
    return [lora_b]


def _block_pieces(
    key: str,
    module: str,
    factor: str,
    tensor: torch.Tensor,
    blocks: tuple[tuple[str, ...], ...],
    model: ModelConfig,
) -> dict[str, torch.Tensor]:
    """Hugging Face module -> its ``A`` (r, H_in) or ``B`` (out, r) from one fused factor.

    Raises:
        ValueError: when the rank does not split into ``blocks``, or ``B`` is non-zero
            outside its blocks (not a per-projection adapter of these targets).
    """
    if factor != "lora_A" and factor != "lora_B":  # a row vector (N,), e.g. DoRA's magnitude
        rows = _split_b(module, tensor[:, None], model)
        out = {}
        for hf, piece in zip(PROJECTIONS[module], rows, strict=True):
            if any(hf in block for block in blocks):
                out[hf] = piece[:, 0]
            elif bool(piece.any()):
                raise ValueError(
                    f"adapter tensor {key!r} is non-zero on {hf} rows, which its "
                    f"target_modules do not adapt"
                )
        return out
    dim = 0 if factor == "lora_A" else 1
    if tensor.shape[dim] % len(blocks):
        raise ValueError(
            f"adapter tensor {key!r} has rank {tensor.shape[dim]}, not a multiple "
            f"of its {len(blocks)} LoRA blocks on {module}"
        )
    rank = tensor.shape[dim] // len(blocks)
    if factor == "lora_A":
        return {
            hf: tensor[j * rank : (j + 1) * rank] for j, block in enumerate(blocks) for hf in block
        }
    rows = dict(zip(PROJECTIONS[module], _split_b(module, tensor, model), strict=True))
    out = {}
    for hf, b in rows.items():  # b: (out, blocks·r)
        j = next((j for j, block in enumerate(blocks) if hf in block), None)
        live = torch.zeros(b.shape[1], dtype=torch.bool)
        if j is not None:
            live[j * rank : (j + 1) * rank] = True
            out[hf] = b[:, live]
        if bool(b[:, ~live].any()):
            raise ValueError(
                f"adapter tensor {key!r} has non-zero entries outside its LoRA "
                f"blocks ({hf} rows); its target_modules do not match the weights"
            )
    return out


def _peft_key(
    layer: str, module: str, hf: str, factor: str, kind: AdapterType, model: ModelConfig
) -> str:
    """PEFT's name of one tensor: ``...{hf}.lora_A.weight``, or the row vector's own key."""
    tail = kind.peft_row_vector if factor == kind.row_vector else f"{factor}.weight"
    return f"{_PEFT}{_layers(model)}.{layer}.{_HF_BLOCK[module]}.{hf}.{tail}"


def peft_state_dict(
    megatron_state: dict[str, torch.Tensor],
    model: ModelConfig,
    target_modules: list[str],
    kind: AdapterType = LORA,
) -> dict[str, torch.Tensor]:
    """Map an adapter's full (unsharded) Megatron tensors to PEFT names.

    Args:
        megatron_state: ``decoder.layers.{i}.{self_attention|mlp}.{module}.lora_A``
            (k·r, H_in) and ``...lora_B`` (N, k·r) tensors, ``k`` the adapter's LoRA blocks
            on that module (1 but for per-projection targets; `config.lora_blocks`), and for
            a variant with a row vector (DoRA) ``...{module}.<its name>`` (N,).
        model: the base model's sizes.
        target_modules: the adapter's ``target_modules``.
        kind: the adapter's variant (`adapter_types.adapter_type`).

    Returns:
        ``base_model.model.model.layers.{i}.{self_attn|mlp}.{hf}.lora_{A|B}.weight`` tensors
        (``...model.language_model.layers...`` for a multimodal Gemma 3 base): ``A``
        (r, H_in), ``B`` (out, r) per Hugging Face module the adapter targets, and DoRA's
        ``...{hf}.lora_magnitude_vector`` (out,).

    Raises:
        ValueError: for a key that names no LoRA module the targets adapt, or weights that
            are not block-structured as the targets say.
    """
    blocks = lora_blocks(target_modules)
    factors = ("lora_A", "lora_B") + (() if kind.row_vector is None else (kind.row_vector,))
    out: dict[str, torch.Tensor] = {}
    for key, tensor in megatron_state.items():
        parts = key.split(".")
        if len(parts) != 6 or parts[0:2] != ["decoder", "layers"] or parts[4] not in blocks:
            raise ValueError(
                f"adapter tensor {key!r} names no LoRA module of target_modules "
                f"{list(target_modules)}"
            )
        layer, module, factor = parts[2], parts[4], parts[5]
        if factor not in factors:
            raise ValueError(f"adapter tensor {key!r} must end in one of {list(factors)}")
        pieces = _block_pieces(key, module, factor, tensor, blocks[module], model)
        for hf, piece in pieces.items():
            name = _peft_key(layer, module, hf, factor, kind, model)
            out[name] = piece.detach().to(torch.float32).contiguous().clone()
    return out


def peft_adapter_config(
    adapter: AdapterConfig, base: str | None = None, *, model: ModelConfig | None = None
) -> dict:
    """The ``adapter_config.json`` of ``adapter`` (``base``: the base model's folder, if any).

    ``target_modules`` lists the Hugging Face projections, or for a multimodal Gemma 3
    ``model`` is a pattern PEFT matches against whole module names: the language model's
    layers only.
    """
    targets: list[str] | str = sorted(
        {
            hf
            for blocks in lora_blocks(adapter.target_modules).values()
            for block in blocks
            for hf in block
        }
    )
    if model is not None and model.hf_multimodal:
        targets = rf"^{re.escape(_MULTIMODAL_LAYERS)}\.\d+\.(self_attn|mlp)\.({'|'.join(targets)})$"
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": adapter.rank,
        "lora_alpha": adapter.alpha,
        "lora_dropout": adapter.dropout,
        "use_rslora": adapter.use_rslora,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_dora": False,
        **adapter_type(adapter).peft_config,
    }


class ExportError(ValueError):
    """An export that would lie or destroy files: non-finite weights, a foreign folder."""


def check_finite_weights(adapter: AdapterConfig, megatron_state: dict[str, torch.Tensor]) -> None:
    """Refuse (`ExportError`) an adapter with a NaN or infinite weight."""
    bad = sorted(k for k, t in megatron_state.items() if not bool(torch.isfinite(t).all()))
    if bad:
        raise ExportError(
            f"adapter {adapter.name!r} has NaN or infinite weights in "
            f"{len(bad)} tensors ({bad[0]}, ...); nothing exported (lower its lr "
            f"or alpha, check the data, or export an older checkpoint)"
        )


def _tmp_sibling(folder: Path) -> Path:
    """The temporary folder ``folder`` is written into (hidden: no adapter name collides)."""
    return folder.with_name(f".{folder.name}.tmp")


def write_peft_folder(
    folder: str | Path,
    adapter: AdapterConfig,
    megatron_state: dict[str, torch.Tensor],
    model: ModelConfig,
) -> Path:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` atomically.

    The files go to a temporary sibling folder first, which replaces ``folder`` only once
    complete, so a crash never leaves a half-written adapter.

    Raises:
        ExportError: when a weight is NaN or infinite (nothing is written).
    """
    check_finite_weights(adapter, megatron_state)
    kind = adapter_type(adapter)
    peft = peft_state_dict(megatron_state, model, adapter.target_modules, kind)
    return _write_peft(Path(folder), adapter, peft, model)


def _write_peft(
    folder: Path, adapter: AdapterConfig, peft: dict[str, torch.Tensor], model: ModelConfig
) -> Path:
    """`write_peft_folder` of a state already in PEFT's names."""
    tmp = _tmp_sibling(folder)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(peft, str(tmp / "adapter_model.safetensors"))
    (tmp / "adapter_config.json").write_text(
        json.dumps(peft_adapter_config(adapter, model.hf_path, model=model), indent=2) + "\n",
        encoding="utf-8",
    )
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    return folder


def _checkpoint_layers(source: Path) -> str:
    """The name prefix of the decoder layers' tensors in the checkpoint files at ``source``.

    ``model.layers.`` for a CausalLM; a multimodal Gemma 3 saved by transformers 5 names its
    language model ``language_model.model.layers.``, other tools ``model.language_model.``.
    """
    from safetensors import safe_open

    index = source / "model.safetensors.index.json"
    if index.is_file():
        names = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    else:
        with safe_open(str(source / "model.safetensors"), framework="pt") as f:
            names = list(f.keys())
    embeddings = sorted(n for n in names if n.endswith("embed_tokens.weight"))
    if not embeddings:
        raise ValueError(f"base checkpoint {str(source)!r} holds no ...embed_tokens.weight")
    return embeddings[0].removesuffix("embed_tokens.weight") + "layers."


def _merge_factors(
    kind: AdapterType, peft_state: dict[str, torch.Tensor], layers: str
) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """``(A, B, row vector or None)`` of each adapted module, by its checkpoint weight name.

    ``layers``: the checkpoint's prefix of the layer tensors (`_checkpoint_layers`).
    """
    factors = {}
    for key, lora_a in peft_state.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removesuffix(".lora_A.weight")
        vector = None
        if kind.row_vector is not None:
            vector = peft_state[f"{module}.{kind.peft_row_vector}"]
        in_layers = re.sub(r"^.*?\.layers\.", "", module.removeprefix(_PEFT))  # "{i}.self_attn.."
        factors[f"{layers}{in_layers}.weight"] = (
            lora_a,
            peft_state[f"{module}.lora_B.weight"],
            vector,
        )
    return factors


def write_merged_checkpoint(
    folder: str | Path,
    adapter: AdapterConfig,
    megatron_state: dict[str, torch.Tensor],
    model: ModelConfig,
) -> Path:
    """Write the base checkpoint ``model.hf_path`` with ``adapter`` merged in, atomically.

    Every file of the base folder is copied; each safetensors file (one at a time, so memory
    stays at one shard) gets the variant's merged weight on the adapted modules (``W +
    scale·B·A``; DoRA's rescaled by ``m / ‖W + scale·B·A‖_row``), in ``W``'s dtype.

    Raises:
        ValueError: when the run's base is not a Hugging Face checkpoint, or a module to merge
            into is missing from it.
    """
    check_finite_weights(adapter, megatron_state)
    kind = adapter_type(adapter)
    peft = peft_state_dict(megatron_state, model, adapter.target_modules, kind)
    return _write_merged(Path(folder), adapter, peft, model)


def _write_merged(
    folder: Path, adapter: AdapterConfig, peft: dict[str, torch.Tensor], model: ModelConfig
) -> Path:
    """`write_merged_checkpoint` of a state already in PEFT's names."""
    if model.hf_path is None:
        raise ValueError(
            "merging needs a Hugging Face base (model.hf_path); this run was "
            "trained on a random base, which has no checkpoint to merge into"
        )
    kind = adapter_type(adapter)
    source, folder = Path(model.hf_path), Path(folder)
    factors = _merge_factors(kind, peft, _checkpoint_layers(source))
    scale = adapter_scaling(adapter)
    tmp = _tmp_sibling(folder)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    merged = set()
    for path in sorted(source.iterdir()):
        if not path.is_file():
            continue
        if path.suffix != ".safetensors":
            shutil.copy2(path, tmp / path.name)
            continue
        tensors = load_file(str(path))
        for name in tensors.keys() & factors.keys():
            weight = tensors[name]
            lora_a, lora_b, vector = factors[name]
            new_weight = kind.merged_weight(weight, lora_a, lora_b, scale, vector)  # fp32
            tensors[name] = new_weight.to(weight.dtype).contiguous()
            merged.add(name)
        save_file(tensors, str(tmp / path.name), metadata={"format": "pt"})
    missing = sorted(factors.keys() - merged)
    if missing:
        shutil.rmtree(tmp)
        raise ValueError(f"base checkpoint {str(source)!r} lacks the adapted weights {missing}")
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    return folder


EXPORT_MARKER = ".lorafusion-export.json"  # in an export folder: the folders we wrote there


def _claim_export_folder(out: Path, targets: list[str]) -> list[str]:
    """Check that ``out`` may receive ``targets`` (sub-folder names); returns those we wrote.

    ``out`` must be missing, empty, or an export folder of ours (it holds `EXPORT_MARKER`),
    and an existing target must be one we wrote there: a user's file is never replaced.

    Raises:
        ExportError: naming the folder (or file) that would be overwritten.
    """
    if out.exists() and not out.is_dir():
        raise ExportError(f"export folder {str(out)!r} is a file; --out must name a folder")
    if not out.exists() or not any(out.iterdir()):
        return []
    marker = out / EXPORT_MARKER
    try:
        ours = json.loads(marker.read_text(encoding="utf-8"))["written"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ExportError(
            f"export folder {str(out)!r} is not empty and was not written by "
            f"lorafusion export (no readable {EXPORT_MARKER}); refusing to "
            f"overwrite it: choose a new or empty folder"
        ) from None
    foreign = [t for t in targets if (out / t).exists() and t not in ours]
    if foreign:
        raise ExportError(
            f"export folder {str(out / foreign[0])!r} exists and was not written "
            f"by lorafusion export; refusing to replace it: move it away or "
            f"choose another --out"
        )
    return list(ours)


def _adapter_sources(source: Path, names: list[str] | None) -> tuple[JobConfig, dict[str, Path]]:
    """The run's job and, per adapter to export, what holds its weights.

    ``source`` is a run folder (each done adapter's export folder, each other one's newest
    complete checkpoint) or one adapter's checkpoint folder (``checkpoints/<name>/step_<n>``).

    Raises:
        ValueError: for a folder that is neither, an adapter with nothing to export, or a
            damaged newest checkpoint (never an older one in its place: it would export
            other weights than the run's last).
    """
    from megatron_lorafusion.train.checkpoint import AdapterCheckpoints, Shard

    one = source.name.startswith("step_") and (source / "shard_tp0_pp0.json").is_file()
    run = source.parents[2] if one else source
    if not (run / "job.json").is_file():
        raise ValueError(
            f"{str(source)!r} is neither a run folder (with job.json) nor a checkpoint "
            "folder of one (checkpoints/<adapter>/step_<n>)"
        )
    cfg = job_from_dict(json.loads((run / "job.json").read_text(encoding="utf-8")))
    unsafe = [
        q
        for i, a in enumerate(cfg.adapters)
        if (q := adapter_name_problem(a.name, f"adapters.{i}.name")) is not None
    ]
    if unsafe:  # a run written before names were checked: never build a path out of them
        raise ValueError(f"{str(run)!r}: job.json: " + "; ".join(unsafe))
    if one:
        return cfg, {source.parent.name: source}
    found = {}
    for adapter in cfg.adapters:
        if names is not None and adapter.name not in names:
            continue
        folder = source / "checkpoints" / adapter.name
        exported = source / "adapters" / adapter.name
        if (folder / "done.json").is_file() and (exported / "adapter_model.safetensors").is_file():
            found[adapter.name] = exported
            continue
        store = AdapterCheckpoints(
            folder, adapter.name, Shard(0, cfg.parallel.tp, 0, cfg.parallel.pp)
        )
        steps = store.steps()
        if not steps:
            raise ValueError(
                f"adapter {adapter.name!r} has no checkpoint and no export under {str(source)!r}"
            )
        if not store.is_complete(steps[0]):
            raise ValueError(
                f"the newest checkpoint of adapter {adapter.name!r}, "
                f"{str(store.step_folder(steps[0]))!r}, is incomplete; name an older one "
                "(--checkpoint checkpoints/<adapter>/step_<n>) to export it"
            )
        found[adapter.name] = store.step_folder(steps[0])
    return cfg, found


def _checkpoint_tensors(folder: Path, name: str, *, newest: bool) -> dict[str, torch.Tensor]:
    """An adapter's weights from one checkpoint folder; a damaged newest one names the older.

    Raises:
        ValueError: for a damaged checkpoint (never an older one in its place: it would
            export other weights than the run's last).
    """
    from megatron_lorafusion.train.checkpoint import CheckpointError, full_adapter_tensors

    try:
        return full_adapter_tensors(folder, name)
    except CheckpointError as err:
        if not newest:
            raise
        older = sorted(p.name for p in folder.parent.glob("step_*") if p.name < folder.name)
        hint = (
            f"; to export an older one, name it (--checkpoint checkpoints/{name}/{older[-1]})"
            if older
            else ""
        )
        raise ValueError(
            f"the newest checkpoint of adapter {name!r}, {str(folder)!r}, is damaged ({err}){hint}"
        ) from None


def export_checkpoint(
    source: str | Path, out: str | Path, *, merge: bool = False, names: list[str] | None = None
) -> list[Path]:
    """Export the adapters of a run, or one adapter's checkpoint.

    ``out/<adapter name>/`` becomes a PEFT folder; with ``merge``, ``out/<name>-merged/`` a
    Hugging Face checkpoint with the adapter merged into the base weights.

    Args:
        source: a run's ``train.output_dir`` (each done adapter's export, each other one's
            newest complete checkpoint) or one ``checkpoints/<adapter>/step_<n>`` folder.
        out: the export folder.
        merge: also write merged checkpoints (needs a base imported from ``model.hf_path``).
        names: adapters to export (default: all).

    Returns:
        The folders written.

    Raises:
        ValueError: for a missing or damaged checkpoint, an unknown adapter name, or a merge
            without a Hugging Face base.
        ExportError: for non-finite weights, or an ``out`` that is a file, a non-empty folder
            not written by export, or holds a same-named folder it did not write.
    """
    cfg, sources = _adapter_sources(Path(source), names)
    adapters = {a.name: a for a in cfg.adapters}
    unknown = sorted(set(names or []) - adapters.keys())
    if unknown:
        raise ValueError(f"adapters {unknown} are not in the run; it has {sorted(adapters)}")
    chosen = [n for n in (names or list(adapters)) if n in sources]
    clashes = sorted(n for n in chosen if merge and f"{n}-merged" in adapters)
    if clashes:
        raise ValueError(
            f"--merge would write {clashes[0]}-merged/ over the adapter of that "
            f"name; export them without --merge or separately"
        )
    peft = {}
    for name in chosen:  # all or nothing: no folder written while another would be refused
        adapter, where = adapters[name], sources[name]
        if where.name.startswith("step_"):
            state = _checkpoint_tensors(where, name, newest=Path(source) != where)
            check_finite_weights(adapter, state)
            kind = adapter_type(adapter)
            peft[name] = peft_state_dict(state, cfg.model, adapter.target_modules, kind)
        else:
            peft[name] = load_file(str(where / "adapter_model.safetensors"))
            check_finite_weights(adapter, peft[name])
    out = Path(out)
    targets = [t for n in chosen for t in ([n, f"{n}-merged"] if merge else [n])]
    ours = _claim_export_folder(out, targets)
    out.mkdir(parents=True, exist_ok=True)
    ours = sorted(set(ours) | set(targets))  # recorded first: a crash leaves them claimable
    (out / EXPORT_MARKER).write_text(
        json.dumps({"written": ours}, indent=2) + "\n", encoding="utf-8"
    )
    written = []
    for name in chosen:
        written.append(_write_peft(out / name, adapters[name], peft[name], cfg.model))
        if merge:
            written.append(
                _write_merged(out / f"{name}-merged", adapters[name], peft[name], cfg.model)
            )
    return written
