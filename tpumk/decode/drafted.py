"""Generation with a hidden-state drafter (`tpumk generate --draft KIND...`, issue 56).

`--draft` names where the drafter comes from:

    eagle3:DIR | dflash:DIR | dflash2:DIR | dspark:DIR | mtp:DIR   a speculators directory
    mtp                                                            the target checkpoint's own
                                                                   next-token layer (--checkpoint)
    KIND:random | KIND:key=value,...                               random weights of a shape
                                                                   (tpumk.draft.random_drafter's
                                                                   keywords; --seed)

The target's step and the drafter run in `tpumk.draft.rounds`' device loop: the prompts are
prefilled by the reference with the drafter's taps, then every round's verify step is the
megakernel planned for q = block + 1 with those taps (or the reference's step), `rounds_per_call`
rounds per device call. On many devices the cache is put in the kernel's layout once, before
the loop, and back after it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tpumk.errors import ConfigError

RANDOM_INT_KEYS = ("layers", "heads", "kv_heads", "head_dim", "ffn", "block", "block_size", "draft_vocab",
                   "markov_rank", "conv_kernel", "conv_group", "selector_rank", "selector_top_k", "taps", "hidden")
RANDOM_STR_KEYS = ("markov_head", "dtype")
# The keys each kind's shape reads (random_drafter ignores the others: refused here, never ignored).
# `hidden` is the target's hidden size (a drafter's layers are as wide as its target's): checked, not set.
_LAYER_KEYS = ("layers", "heads", "kv_heads", "head_dim", "ffn", "taps", "block", "draft_vocab", "dtype", "hidden")
KIND_KEYS = {"eagle3": _LAYER_KEYS,
             "dflash": _LAYER_KEYS + ("block_size",),
             "dflash2": _LAYER_KEYS + ("block_size", "conv_kernel", "conv_group", "selector_rank", "selector_top_k"),
             "dspark": _LAYER_KEYS + ("block_size", "markov_rank", "markov_head"),
             "mtp": ("block", "dtype", "hidden")}  # a next-token layer of the target's own kind


def hidden_kind(value: str | None) -> str | None:
    """The drafter kind a --draft value names when it is a hidden-state drafter, else None."""
    from tpumk.draft import KINDS

    if value is None:
        return None
    kind = value.strip().split(":", 1)[0]
    return kind if kind in KINDS else None


def parse_random_shape(kind: str, text: str, target) -> dict[str, Any]:
    """`random` or `key=value,...` -> random_drafter keywords; taps=N spreads N taps (or
    taps=a/b/c names them)."""
    from tpumk.draft.drafter import spread

    if text == "random":
        return {}
    out: dict[str, Any] = {}
    for item in text.split(","):
        key, sep, val = item.partition("=")
        key, val = key.strip(), val.strip()
        allowed = KIND_KEYS.get(kind, RANDOM_INT_KEYS + RANDOM_STR_KEYS)
        if not sep or key not in allowed:
            raise ConfigError(f"--draft {kind}:{text}: expected a directory, 'random' or key=value pairs of "
                              f"{', '.join(allowed)} (got {item.strip()!r})")
        if key in out:
            raise ConfigError(f"--draft {kind}:{text}: {key} given twice")
        if key in RANDOM_STR_KEYS:
            out[key] = val
            continue
        if key == "taps" and "/" in val:
            parts = val.split("/")
        else:
            parts = [val]
        try:
            nums = [int(p) for p in parts]
        except ValueError:
            raise ConfigError(f"--draft {kind}:{text}: {key} = {val!r}: expected an integer") from None
        least = 0 if key in ("taps", "markov_rank") else 1  # markov_rank 0: no Markov bias
        if any(n < least for n in nums):
            raise ConfigError(f"--draft {kind}:{text}: {key} = {val!r}: expected an integer of at least {least}")
        if key == "hidden":
            if nums[0] != target.hidden_size:
                raise ConfigError(f"--draft {kind}:{text}: hidden = {nums[0]}: expected the target's hidden size "
                                  f"{target.hidden_size} (a drafter's layers are as wide as its target's)")
            continue
        if key == "taps":
            if len(nums) == 1 and nums[0] == 0:
                raise ConfigError(f"--draft {kind}:{text}: taps = 0: expected a tap count of at least 1 or "
                                  "layer numbers a/b/c")
            out["taps"] = tuple(nums) if len(nums) > 1 else spread(target.num_layers, nums[0])
        else:
            out[key] = nums[0]
    return out


def random_shape(kind: str, src: str, target, block: int | None) -> dict[str, Any] | None:
    """The random drafter's shape keywords a --draft source names (`random`, or key=value,...
    that is not a directory), `block` filling in the drafts per round when the source does not;
    None when the source names a directory to read. One rule for describe, load and round_spec,
    so bench, generate and build read a --draft value alike."""
    from tpumk.files import is_dir

    if src != "random" and not ("=" in src and not is_dir(Path(src))):
        return None
    kw = parse_random_shape(kind, src, target)
    if block is not None:
        kw.setdefault("block", block)
    return kw


def describe(value: str, target, block: int | None = None):
    """The DrafterSpec (shapes only, no weights read or made) a --draft value names for `target`:
    what `tpumk bench --draft` models. `mtp` alone: a next-token layer of the target's own kind
    (whether a checkpoint ships one is not read); KIND:DIR reads only the directory's config.json."""
    from tpumk.draft import KINDS, random_drafter
    from tpumk.draft.drafter import read_drafter_spec

    value = value.strip()
    kind, _, src = value.partition(":")
    if kind not in KINDS:
        raise ConfigError(f"--draft {value!r}: expected KIND[:SHAPE] with KIND one of {', '.join(KINDS)}")
    if not src and kind != "mtp":
        raise ConfigError(f"--draft {value}: expected {kind}:DIR (a speculators directory), {kind}:random or "
                          f"{kind}:key=value,... (a drafter of that shape)")
    kw = random_shape(kind, src, target, block) if src else ({} if block is None else {"block": block})
    if kw is None:
        spec = read_drafter_spec(Path(src), target, block=block)
        if spec.kind != kind:
            raise ConfigError(f"--draft {value}: the directory holds a {spec.kind} drafter, not {kind}")
        return spec
    return random_drafter(kind, target, abstract=True, **kw).spec


def load(value: str, target, checkpoint: str | None, seed: int = 0, block: int | None = None,
         target_params: dict | None = None):
    """The Drafter a --draft value names, for `target` (ModelConfig). Bad input: one line."""
    from tpumk.draft import load_drafter, random_drafter
    from tpumk.files import is_dir

    value = value.strip()
    kind, _, src = value.partition(":")
    if kind == "mtp" and not src:
        if checkpoint is None or not is_dir(Path(checkpoint)):
            raise ConfigError("--draft mtp: reads the target checkpoint's next-token layer: give --checkpoint DIR "
                              "(or mtp:DIR, a speculators mtp directory)")
        return load_drafter("mtp", target, checkpoint=checkpoint, block=block)
    if not src:
        raise ConfigError(f"--draft {value}: expected {kind}:DIR (a speculators directory), {kind}:random or "
                          f"{kind}:key=value,... (a random drafter of that shape)")
    kw = random_shape(kind, src, target, block)
    if kw is not None:
        return random_drafter(kind, target, seed=seed, **kw)
    return load_drafter(src, target, block=block, target_params=target_params)


def round_spec(value: str, target, checkpoint: str | None = None, seed: int = 0, block: int | None = None,
               rounds_per_call: int = 8, temperature: float = 0.0):
    """The round program a --draft value names for `target` (`tpumk build / export / cache-key /
    tune --draft`): (RoundSpec, the drafter's weights). A random drafter (KIND:random,
    KIND:key=value,...) is named by its shape and `seed` and its weights are not made (None:
    `random_params(spec, seed)` remakes them); a speculators directory or `mtp` (the
    --checkpoint's own next-token layer) is read, and the RoundSpec records its weights' content
    hash. Bad input: one line."""
    from tpumk.draft import KINDS, random_drafter
    from tpumk.draft.rounds import RoundSpec
    from tpumk.draft.weights import weights_sha256

    value = value.strip()
    kind, _, src = value.partition(":")
    if kind not in KINDS:
        raise ConfigError(f"--draft {value!r}: a round program takes a hidden-state drafter: expected KIND[:SOURCE] "
                          f"with KIND one of {', '.join(KINDS)} (ngram and model:... are generate's --spec)")
    kw = random_shape(kind, src, target, block)
    if kw is not None:
        d = random_drafter(kind, target, seed=seed, abstract=True, **kw)
        return RoundSpec(d.spec, ("random_seed", seed), rounds_per_call, temperature), None
    d = load(value, target, checkpoint, seed=seed, block=block)
    return RoundSpec(d.spec, ("sha256", weights_sha256(d.params)), rounds_per_call, temperature), d.params


def generate(m, prompts: list[list[int]], steps: int, drafter, backend: str = "reference", page_size: int = 16,
             devices: int = 1, kv_dtype: str = "", rounds_per_call: int = 8, temperature: float = 0.0,
             seed: int = 0, on_call=None) -> dict:
    """Generate with `drafter` (tpumk.draft.Drafter) through `backend`'s verify step; returns what
    `tpumk.decode.generate.generate` returns, the rounds' figures under "spec". `on_call`:
    rounds.generate's (the carry after every device call)."""
    import time

    import jax

    from tpumk.draft import rounds
    from tpumk.decode.generate import (_init_cache, _kernel_step, _megakernel_where, check_host_memory,
                                       kernel_cache_layout)
    from tpumk.model import reference

    settings = rounds.RoundSettings(drafter.block, steps, rounds_per_call, temperature)
    k = drafter.block
    context = rounds.required_context(prompts, steps, k)
    context = -(-context // page_size) * page_size
    check_host_memory(m.cfg, len(prompts), context, [(1, max(len(p) for p in prompts)), (len(prompts), k + 1)])
    cache = _init_cache(m.cfg, len(prompts), context, page_size, "", kv_dtype, pending=k + 1)
    taps = drafter.taps
    prefill = jax.jit(lambda t, p, c: reference.decode_step(m.params, m.cfg, t, p, c, taps=taps))
    layout = None
    if backend == "reference":
        verify = lambda pk, t, p, c: reference.decode_step(pk, m.cfg, t, p, c, taps=taps)  # noqa: E731
        packed = m.params
    else:
        from tpumk.kernel.layout import pack_sharded
        plan, step = _kernel_step(m.cfg, len(prompts), context, page_size, k + 1, devices, m.quant, kv_dtype, taps)
        from tpumk.kernel.draft_pass import through_kernel
        from tpumk.kernel.megakernel import step_mesh
        packed = pack_sharded(plan, m.params)
        verify = step
        layout = kernel_cache_layout(m.cfg, plan)
        drafter = through_kernel(drafter, plan.target, step_mesh(plan) if devices > 1 else None)
    t0 = time.perf_counter()
    tokens, _, stats = rounds.generate(prefill, verify, drafter, packed, drafter.params,
                                       rounds.target_for_drafter(m.params), prompts, cache,
                                       settings, seed=seed, layout=layout, on_call=on_call)
    seconds = time.perf_counter() - t0
    spec_info = {"method": drafter.kind, "drafter": repr(drafter), "temperature": temperature,
                 "rounds_per_call": rounds_per_call, **stats.to_dict(),
                 "note": "acceptance counts are exact on this host; tokens per verify step = accepted drafts + 1"}
    return {"model": m.cfg.name, "backend": backend, "devices": devices, "weights": m.source, "steps": steps,
            "kv_dtype": kv_dtype or m.cfg.dtype, "prompts": prompts, "tokens": tokens, "seconds": seconds,
            "ran_on": "reference decode step (pure JAX) on this host" if backend == "reference"
            else _megakernel_where(devices), "spec": spec_info,
            "timing_note": "wall time on this host, including compilation; not a TPU speed figure"}
