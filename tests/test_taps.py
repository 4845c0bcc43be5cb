"""Hidden-state taps (issue 56): the reference's tapped hidden states are transformers'
`output_hidden_states` (tap t < num_layers: the residual stream entering layer t; tap
num_layers: the final norm's output), in decode steps and full forwards alike."""

from __future__ import annotations

import hf_utils  # first: offline hub, quiet transformers
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tpumk.errors import ConfigError
from tpumk.model import reference
from tpumk.model.checkpoint import load_checkpoint


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = hf_utils.build_checkpoint(tmp_path_factory.mktemp("llama"), arch="llama", num_hidden_layers=3)
    cfg, params = load_checkpoint(path)[:2]
    return path, cfg, params


def test_reference_taps_are_transformers_hidden_states(llama):
    path, cfg, params = llama
    toks = np.array([[5, 7, 9, 11, 13]])
    with torch.no_grad():
        hs = hf_utils.load_model(str(path))(torch.tensor(toks), output_hidden_states=True).hidden_states
    taps = (0, 2, cfg.num_layers)
    logits, full = reference.forward_full(params, cfg, jnp.asarray(toks), taps=taps)
    for j, t in enumerate(taps):
        np.testing.assert_allclose(np.asarray(full[:, :, j]), hs[t].numpy(), atol=1e-4, rtol=1e-4)  # float32 sums in another order
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(reference.forward_full(params, cfg, jnp.asarray(toks))))
    # the paged decode step taps the same rows, in two steps
    cache = reference.init_cache(cfg, 1, 16)
    _, cache, first = reference.decode_step(params, cfg, jnp.asarray(toks[:, :3]), jnp.arange(3)[None], cache, taps=taps)
    _, cache, second = reference.decode_step(params, cfg, jnp.asarray(toks[:, 3:]), jnp.arange(3, 5)[None], cache,
                                             taps=taps)
    np.testing.assert_allclose(np.concatenate([first, second], axis=1), np.asarray(full), atol=1e-5)


@pytest.mark.parametrize("taps", [(4,), (-1,), (1, 1)])
def test_bad_taps_are_refused(llama, taps):
    _, cfg, params = llama
    with pytest.raises(ConfigError, match=r"taps .*expected distinct layer numbers 0 to 3"):
        reference.forward_full(params, cfg, jnp.zeros((1, 2), jnp.int32), taps=taps)
