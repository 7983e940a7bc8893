"""The model's shape for the analytic MFU numerator (analyze/analyses/mfu.py): non-embedding parameters,
transformer layers and hidden size, recorded once in the manifest (`run.model_shape`).

Per token a transformer's forward does 2 FLOPs per weight (an embedding lookup does none) plus the
attention scores and their product with V, 4 x seq x hidden per layer; forward + backward is 3x that:
6 N + 12 L T d per token (Chowdhery et al. 2022, PaLM, App. B). N counts every parameter but the embedding
tables, as Kaplan et al. 2020 do (biases and norms included; an untied output layer is a matmul and counts).

Where the layers and hidden size come from, best first: the collector's settings (`model_layers`,
`model_hidden`), a Hugging Face style `config` on the model, the model's structure (the longest
ModuleList of two or more modules of one class, and the width of the first norm or Linear inside one).
`shape_from` says which. Under ZeRO-3 a parameter's full size is `ds_numel` (its `numel()` is its shard).
"""

from __future__ import annotations

LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model", "dim")


def full_numel(param) -> int:
    return int(getattr(param, "ds_numel", None) or param.numel())


def embedding_params(model) -> int:
    """Parameters of embedding tables that no Linear shares (a tied output layer's weight does matmul work)."""
    from torch import nn

    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    return sum(full_numel(m.weight) for m in model.modules()
               if isinstance(m, nn.Embedding) and id(m.weight) not in linear_weights)


def _from_config(model) -> tuple[int | None, int | None]:
    config = getattr(model, "config", None)
    if config is None:
        return None, None
    pick = lambda keys: next((v for k in keys if type(v := getattr(config, k, None)) is int and v > 0), None)  # noqa: E731
    return pick(LAYER_KEYS), pick(HIDDEN_KEYS)


def _width(block) -> int | None:
    """The hidden size a block works at: its first norm's width, else its first Linear's input features."""
    from torch import nn

    for module in block.modules():
        shape = getattr(module, "normalized_shape", None)
        if isinstance(module, nn.LayerNorm) and shape:
            return int(shape[-1])
        if type(module).__name__.endswith("RMSNorm") and getattr(module, "weight", None) is not None:
            return full_numel(module.weight)
    first = next((m for m in block.modules() if isinstance(m, nn.Linear)), None)
    return int(first.in_features) if first is not None else None


def _from_structure(model) -> tuple[int | None, int | None]:
    from torch import nn

    stacks = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) >= 2
              and len({type(child) for child in m}) == 1]
    if not stacks:
        return None, None
    blocks = max(stacks, key=len)
    return len(blocks), _width(blocks[0])


def describe(model, layers: int | None = None, hidden: int | None = None) -> dict:
    """`model_shape` for the manifest: param_count, embedding_params, non_embedding_params, layers, hidden, shape_from."""
    param_count = sum(full_numel(p) for p in model.parameters())
    embedding = embedding_params(model)
    shape_from = "settings" if layers and hidden else None
    if not shape_from:
        for name, (found_layers, found_hidden) in (("model config", _from_config(model)),
                                                  ("model structure", _from_structure(model))):
            if found_layers and found_hidden:
                layers, hidden, shape_from = layers or found_layers, hidden or found_hidden, name
                break
    return {"param_count": param_count, "embedding_params": embedding, "non_embedding_params": param_count - embedding,
            "layers": layers if shape_from else None, "hidden": hidden if shape_from else None, "shape_from": shape_from}
