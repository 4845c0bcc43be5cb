"""vLLM's speculative decoding through the plugin: which target hidden states (taps) the drafter
reads, and which speculative configs are refused (no vLLM import).

vLLM's TPU runner (tpu_inference 0.32) runs its own EAGLE-3 drafter (`Eagle3Proposer`, the JAX
`Eagle3LlamaForCausalLM`, loaded from the `--speculative-config` model directory) after every
target step, on the third value the target model returns: a list of [T, hidden] arrays, the
residual stream entering each of three target layers for every token of the batch. Those layers
are the drafter's `eagle_aux_hidden_state_layer_ids` (vLLM's speculators reader copies them into
the draft config), else vLLM's default (2, L // 2, L - 3), in layer order. vLLM numbers them as tpumk numbers its
taps (id i < L: the stream entering layer i, tpumk.draft.config); id L (the stream after the last
layer, before the final norm) is not one of the plugin's taps: refused. The verify batch that
follows (k + 1 tokens per request, k = num_speculative_tokens) and its rejection sampling are
vLLM's; the plugin runs it through the megakernel's verify step (q_len k + 1, these taps;
tpumk.vllm.runtime builds it beside the decode step, tpumk.vllm.steps.serve_step chooses it),
and any batch with a request of more than k + 1 tokens (a prefill chunk) through its ragged JAX
step, which returns the same taps.
"""

from __future__ import annotations

from tpumk.errors import ServingConfigError

METHODS = ("eagle3",)
AUX_LAYERS = 3  # tpu_inference's eagle3 fc reads 3 x the target's hidden size


def drafter_head_pad(head: int) -> int:
    """The lanes tpu_inference 0.32 adds to each of the drafter's q / k / v heads when it loads
    them (models/jax/utils/weight_utils.py, `_load_hf_weights_on_thread`): get_padded_head_dim(h)
    - h, h the TARGET's `model_config.get_head_size()`, for an MLA target under
    VLLM_MLA_DISABLE=1 qk_nope_head_dim + qk_rope_head_dim (DeepSeek-V3, Kimi K2: 128 + 64 = 192,
    padded to 256: a 128-wide drafter head loaded 192 wide against its 128-lane KV cache, which
    the drafter's attention cannot read). Nonzero: refused."""
    return 0 if head == 64 else -head % 128


def _drafter_head(hf) -> int | None:
    """The drafter's q / k / v head width from its config (None when it names none)."""
    head = getattr(hf, "head_dim", None)
    if head is None and getattr(hf, "hidden_size", None) and getattr(hf, "num_attention_heads", None):
        head = int(hf.hidden_size) // int(hf.num_attention_heads)
    return None if head is None else int(head)


def _check_drafter_head(where: str, cfg, draft_hf) -> None:
    """tpu_inference pads the drafter's heads by the target's padding (`drafter_head_pad`): served
    only when that is the drafter's own (a drafter of the target's head width, or both already
    64 / a multiple of 128). A drafter whose config names no head width is taken as unpadded."""
    target = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim if cfg.is_mla else cfg.head_dim
    drafter = _drafter_head(draft_hf)
    if drafter_head_pad(target) == (0 if drafter is None else drafter_head_pad(drafter)):
        return
    field = "qk_nope_head_dim + qk_rope_head_dim" if cfg.is_mla else "head_dim"
    with_drafter = "" if drafter is None else f" (the drafter's heads are {drafter} wide)"
    raise ServingConfigError(
        f"{where}: model '{cfg.name}' {field} = {target}: expected 64 or a multiple of 128 with eagle3{with_drafter} "
        f"(tpu_inference 0.32 pads the drafter's q / k / v heads by the target's head padding, "
        f"{drafter_head_pad(target)} lanes here, which its drafter's attention cannot read)")


def speculative_taps(vllm_config, cfg) -> tuple[int, ...]:
    """The target layers whose entering hidden states the plugin returns to vLLM's drafter: ()
    without a speculative config. Refuses a method other than eagle3 (and eagle3 with tensor
    parallelism, or on a target whose head tpu_inference pads by other lanes than the drafter's own:
    `_check_drafter_head`) in
    one line naming the field."""
    sc = getattr(vllm_config, "speculative_config", None)
    if sc is None:
        return ()
    where = "tpumk plugin: --speculative-config"
    if sc.method not in METHODS:
        raise ServingConfigError(f"{where} field 'method' = {sc.method!r}: expected one of {list(METHODS)} (the "
                                 "plugin returns the target's hidden states EAGLE-3 reads, no other drafter's inputs)")
    if int(vllm_config.parallel_config.tensor_parallel_size) != 1:
        raise ServingConfigError(f"{where}: tensor_parallel_size {vllm_config.parallel_config.tensor_parallel_size}: "
                                 "expected 1 with speculative decoding (not served on many devices yet)")
    draft = getattr(sc, "draft_model_config", None)
    _check_drafter_head(where, cfg, getattr(draft, "hf_config", None))
    ids = getattr(getattr(draft, "hf_config", None), "eagle_aux_hidden_state_layer_ids", None)
    n = cfg.num_layers
    taps = tuple(int(i) for i in ids) if ids else (2, n // 2, n - 3)  # vLLM's default for eagle3
    if len(taps) != AUX_LAYERS or len(set(taps)) != len(taps) or not all(0 <= i < n for i in taps):
        raise ServingConfigError(f"{where}: the drafter's eagle_aux_hidden_state_layer_ids {list(taps)}: expected "
                                 f"{AUX_LAYERS} distinct layer ids from 0 to {n - 1} (the target's {n} layers; "
                                 f"id {n}, after the last layer before the final norm, is not served)")
    # in layer order: vLLM's models append each tapped stream as their layer loop passes it, and
    # the drafter's fc reads them concatenated in that order, whatever order the config lists
    return tuple(sorted(taps))


def verify_len(vllm_config) -> int:
    """Tokens per request of vLLM's verify batch: the last sampled token and num_speculative_tokens
    drafts (the q_len of the plugin's verify step)."""
    k = getattr(vllm_config.speculative_config, "num_speculative_tokens", None)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ServingConfigError(f"tpumk plugin: --speculative-config field 'num_speculative_tokens' = {k!r}: "
                                 "expected a positive whole number")
    return k + 1
