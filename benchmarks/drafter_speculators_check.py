"""Check that a drafter directory written by benchmarks/drafter_train.py means, to speculators
0.9.0's own torch definition (`Eagle3DraftModel`), what it means to the JAX drafter that was
trained and measured (benchmarks/drafter_eagle3.py): the same logits at every chain step.

speculators pins transformers <= 5.19 and does not install beside tpumk, so the check runs in
two venvs:

    .venv/bin/python benchmarks/drafter_speculators_check.py write --checkpoint GGUF --drafter DIR --probe P.npz
    .venv-spec/bin/python benchmarks/drafter_speculators_check.py check --drafter DIR --probe P.npz

`write` (tpumk's venv) runs the JAX drafter's training forward (`ttt_logits`) on rows of real
target taps (the held-out or training dataset's, `--data`) or, without it, random rows, and
stores inputs, the target's embedding table and the logits; `check` (a venv with speculators
0.9.0: `python3 -m venv .venv-spec && .venv-spec/bin/pip install speculators==0.9.0
torch==2.13.0`, then `pip uninstall torchvision torchaudio`: the torchvision it brings does not
load with that torch) loads the directory with speculators' config class and model, the embedding
from the probe (speculators takes it from the verifier), runs its forward over the same rows and
compares every step's logits. Exit 1 with one line when they differ.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

STEPS = 3
ROWS = 40


def write_probe(a) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    import jax.numpy as jnp

    import drafter_data
    import drafter_eagle3 as e3
    from tpumk.model.gguf import load_gguf

    cfg, target_params = load_gguf(a.checkpoint)
    p, frozen, s, _ = e3.load(a.drafter, cfg, target_params)
    if a.data is not None:  # the first sequence's first rows: real taps and tokens
        d = drafter_data.read_dataset(a.data)
        toks = d["tokens"][1:ROWS + 1].astype(np.int32)
        taps = d["taps"][:ROWS, :3].astype(np.float32)
    else:
        rng = np.random.default_rng(0)
        toks = rng.integers(0, cfg.vocab_size, ROWS).astype(np.int32)
        taps = rng.normal(0, 1, (ROWS, 3, s.hidden)).astype(np.float32)
    pos = np.arange(1, ROWS + 1, dtype=np.int32)
    tokens = np.concatenate([toks, np.zeros(STEPS, np.int32)])  # speculators pads the shifted inputs with 0
    logits = e3.ttt_logits(p, frozen, s, jnp.asarray(tokens)[None], jnp.asarray(taps)[None], jnp.asarray(pos)[None],
                           jnp.ones((1, ROWS), bool), STEPS)
    np.savez(a.probe, input_ids=toks, hidden=taps.reshape(ROWS, -1), positions=pos,
             embed=np.asarray(frozen["embed"], np.float32), logits=np.stack([np.asarray(x[0]) for x in logits]))
    print(f"wrote {a.probe}: {ROWS} rows, {STEPS} steps, logits {tuple(np.asarray(logits[0]).shape)}")


def check_probe(a) -> None:
    import torch
    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel

    z = np.load(a.probe)
    config = Eagle3SpeculatorConfig.from_pretrained(str(a.drafter))
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention wants a compiler on CPU
    model = Eagle3DraftModel(config).float().eval()
    state = {k: v.float() if v.is_floating_point() else v for k, v in load_file(str(a.drafter / "model.safetensors")).items()}
    state["embed_tokens.weight"] = torch.from_numpy(z["embed"])
    missing, unexpected = model.load_state_dict(state, strict=False)
    left = [k for k in missing if not k.startswith("verifier_")]
    if left or unexpected:
        print(f"tpumk: error: {a.drafter / 'model.safetensors'}: missing {left}, unexpected {unexpected}", file=sys.stderr)
        raise SystemExit(1)
    seen = []
    model.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.detach()[0].numpy()))
    with torch.no_grad():
        model(hidden_states=torch.from_numpy(z["hidden"])[None], input_ids=torch.from_numpy(z["input_ids"]).long()[None],
              document_ids=torch.zeros(1, len(z["input_ids"]), dtype=torch.long),
              position_ids=torch.from_numpy(z["positions"]).long()[None], ttt_steps=STEPS)
    want = z["logits"]
    worst = max(float(np.max(np.abs(seen[k] - want[k]))) for k in range(STEPS))
    scale = float(np.max(np.abs(want)))
    agree = [float(np.mean(seen[k].argmax(-1) == want[k].argmax(-1))) for k in range(STEPS)]
    print(f"speculators {STEPS}-step logits vs the JAX drafter: largest difference {worst:.2e} "
          f"(logits up to {scale:.1f}); argmax agreement by step {agree}")
    # float32 both sides, sums in another order: a 1e-4 relative bound is loose for 1.7k-term dots
    if worst > 1e-4 * max(scale, 1.0) or min(agree) < 1.0:
        print("tpumk: error: speculators' Eagle3DraftModel and the JAX drafter disagree", file=sys.stderr)
        raise SystemExit(1)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("--checkpoint", required=True)
    w.add_argument("--drafter", required=True, type=Path)
    w.add_argument("--probe", required=True, type=Path)
    w.add_argument("--data", type=Path, help="a dataset of benchmarks/drafter_data.py (real taps); default random rows")
    c = sub.add_parser("check")
    c.add_argument("--drafter", required=True, type=Path)
    c.add_argument("--probe", required=True, type=Path)
    a = ap.parse_args(argv)
    (write_probe if a.cmd == "write" else check_probe)(a)


if __name__ == "__main__":
    main()
