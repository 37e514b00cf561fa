"""The compute ledger: FLOP counts against XLA's own count and a brute-force count, totals across a resume."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from mimo_jax.models import Transformer
from mimo_jax.models.config import tiny
from mimo_jax.provenance import provenance
from mimo_jax.train.ledger import FlopCounter, Ledger, causal_keys


def test_a_forward_counts_what_xla_counts_for_one_layer():
  """XLA's cost analysis of the unoptimised program (one layer: a scanned stack is counted once) against the
  formula, with the keys the dense attention computes (every key of every query): within the elementwise
  work the formula leaves out."""
  cfg = tiny().replace(d_model=256, mlp_dim=1024, num_heads=4, num_kv_heads=2, num_layers=1)
  graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  B, T = 4, 8
  lowered = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)).lower(state, jnp.zeros((B, T), jnp.int32))
  cost = lowered.cost_analysis()
  xla = (cost[0] if isinstance(cost, list) else cost)["flops"]
  ours = FlopCounter.of(cfg).forward(B * T, B * T * T, B * T)
  assert ours == pytest.approx(xla, rel=0.02) and ours < xla


@pytest.mark.parametrize(
  "impl, remat", [("fused", "none"), ("full", "none"), ("full", "full"), ("full", "dots_no_batch"), ("full", "dots")]
)
def test_an_update_counts_what_xla_counts_for_one_layer(impl, remat):
  """Forward + backward of the log-probs and entropy the update differentiates, against XLA's cost
  analysis of ``jax.grad`` (one layer): the fused kernel's backward recomputes the logits (4 head
  forwards, 3 with full logits); ``--remat=full`` recomputes a layer's forward but its MLP
  down-projection, ``dots_no_batch`` its attention products (the ledger counted 3 forwards of
  everything, 4 with remat full: 11% under with the fused head, 11% over with full logits and remat)."""
  from mimo_jax.models.logprobs import completion_stats

  B, P, M = 4, 8, 8
  cfg = tiny().replace(d_model=256, mlp_dim=512, num_heads=4, num_kv_heads=2, num_layers=1, vocab_size=2048)
  cfg = cfg.replace(remat=remat)
  graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
  ones = (jnp.ones((B, P), jnp.int32), jnp.ones((B, P), bool), jnp.ones((B, M), jnp.int32), jnp.ones((B, M), bool))

  def objective(s):
    logp, entropy = completion_stats(nnx.merge(graphdef, s), *ones, 1.0, impl=impl)
    return jnp.sum(logp) + jnp.sum(entropy)

  cost = jax.jit(jax.grad(objective)).lower(state).cost_analysis()
  xla = (cost[0] if isinstance(cost, list) else cost)["flops"]
  ours = FlopCounter.of(cfg).update([P] * B, [M] * B, remat=remat, fused_head=impl == "fused")
  # XLA's dense attention computes every key of every query, the ledger the causal ones.
  dense = 4 * 4 * 16 * (B * (P + M) ** 2 - int(causal_keys(0, P + M)) * B)
  ours += dense * (4 if remat in ("full", "dots_no_batch") else 3)
  assert ours == pytest.approx(xla, rel=0.02) and ours < xla


def test_the_counts_equal_a_token_by_token_count():
  fc = FlopCounter.of(tiny())
  # tiny: L 2, D 64, N 4, K 2, H 16, F 128, V 256: per token 2 * 2 * (64*64 + 2*64*32 + 64*64 + 3*64*128).
  assert fc.per_token == 147456
  assert fc.forward(3, 6, 2) == 3 * 147456 + 4 * 2 * 4 * 16 * 6 + 2 * 64 * 256 * 2
  assert causal_keys(0, 3) == 6 and causal_keys(3, 2) == 4 + 5

  def one_query(keys: int, logits: bool) -> int:  # one token through the model, attending `keys` keys
    return fc.per_token + 4 * 2 * 4 * 16 * keys + (2 * 64 * 256 if logits else 0)

  prompts, completions = [5, 1, 7], [3, 1, 0]
  brute_gen = brute_score = 0
  for p, c in zip(prompts, completions, strict=True):
    brute_gen += sum(one_query(t, logits=(t == p and c > 0)) for t in range(1, p + 1))  # prefill
    brute_gen += sum(one_query(p + j, logits=True) for j in range(1, c))  # one decode step per further token
    brute_score += sum(one_query(t, logits=t > p) for t in range(1, p + c + 1))
  assert fc.generate(prompts, completions) == brute_gen
  assert fc.score(prompts, completions) == brute_score


def test_a_shared_prompt_is_counted_once_per_group():
  """The sampler prefills a prompt once for its group, and with --share_prompts the learner runs it once and
  each completion after it, less the last token: a token-by-token count of that work."""
  fc = FlopCounter.of(tiny())
  logits = 2 * 64 * 256

  def one_query(keys: int) -> int:
    return fc.per_token + 4 * 2 * 4 * 16 * keys

  prompts, completions = [5, 5, 5, 2, 2, 2], [3, 1, 0, 0, 0, 0]
  brute_gen = brute_score = 0
  for g in range(2):
    p, cs = prompts[3 * g], completions[3 * g : 3 * g + 3]
    brute_gen += sum(one_query(t) for t in range(1, p + 1)) + (logits if max(cs) > 0 else 0)
    brute_score += sum(one_query(t) for t in range(1, p + 1))
    for c in cs:
      brute_gen += sum(one_query(p + j) + logits for j in range(1, c))
      brute_score += sum(one_query(p + j) for j in range(1, c)) + c * logits
  assert fc.generate(prompts, completions, group=3) == brute_gen
  assert fc.score(prompts, completions, group=3) == brute_score
  assert fc.score(prompts, completions, group=3) < fc.score(prompts, completions)
  ledger = Ledger(
    fc,
    use_reference=True,
    use_value=False,
    epochs=1,
    rollout_devices=1,
    learner_devices=1,
    sample_group=3,
    score_group=3,
    update_group=1,
  )
  m = ledger.step(prompts, completions)
  assert m["flops_generate"] == brute_gen and m["flops_score"] == m["flops_reference"] == brute_score
  assert m["flops_learn"] == 3 * fc.score(prompts, completions)  # a shuffled update runs every row's prompt
  with pytest.raises(ValueError, match="groups of 4"):
    fc.score(prompts, completions, group=4)
  # A critic's forward and its update passes share prompts as the policy's do.
  kw = dict(epochs=1, rollout_devices=1, learner_devices=1, sample_group=3, score_group=3)
  critic = Ledger(fc, use_reference=False, use_value=True, update_group=3, **kw).step(
    prompts, completions, value_passes=2
  )
  value = fc.score(prompts, completions, head="value", group=3)
  assert value < fc.score(prompts, completions, head="value")
  assert (
    critic["flops_value"] == value
    and critic["flops_learn"] == 3 * fc.score(prompts, completions, group=3) + 3 * 2 * value
  )


def test_a_step_adds_up_the_phases_and_the_totals_survive_a_checkpoint():
  fc = FlopCounter.of(tiny())
  kw = dict(epochs=2, rollout_devices=2, learner_devices=6)
  ledger = Ledger(fc, use_reference=True, use_value=True, remat="full", fused_head=True, **kw)
  p, c = [4, 6], [2, 3]
  score, value = fc.score(p, c), fc.score(p, c, head="value")
  m = ledger.step(p, c, rounds=2, value_passes=3, time_generate_s=1.5, time_train_s=2.0)
  assert m["flops_generate"] == 2 * fc.generate(p, c) and m["flops_score"] == m["flops_reference"] == score
  # forward + backward with the layers recomputed (remat full) per epoch; the critic's forward for the
  # values and its forward + backward per value pass.
  update = fc.update(p, c, remat="full", fused_head=True)
  # 4 forwards (the fused head's 4th: its recomputed logits), less the 15 tokens' MLP down-projections
  assert update == 4 * score - 15 * 2 * 2 * 64 * 128
  # The critic's forward is its own phase (it runs in the score program); its passes are in the learn phase.
  assert m["flops_value"] == value and m["flops_learn"] == 2 * update + 3 * fc.update(p, c, head="value", remat="full")
  assert m["flops_step"] == m["flops_generate"] + 2 * score + value + m["flops_learn"]
  assert (m["device_s_generate"], m["device_s_train"], m["device_s_total"]) == (3.0, 12.0, 15.0)
  assert (m["samples_total"], m["tokens_total"]) == (2, 15)
  saved = ledger.state_dict()
  m2 = ledger.step(p, c, trained=False, time_generate_s=0.5, time_train_s=0.5)
  plain = Ledger(fc, use_reference=False, use_value=False, **kw)
  # value warm-up (no critic pass asked for here): the policy is not updated, the critic's forward runs
  assert m2["flops_learn"] == 0 and m2["flops_value"] == value
  assert plain.step(p, c)["flops_learn"] == 3 * 2 * score and plain.step(p, c)["flops_reference"] == 0
  assert plain.step(p, c)["flops_value"] == 0
  resumed = Ledger(fc, use_reference=True, use_value=True, remat="full", fused_head=True, **kw)
  resumed.load_state_dict(saved)
  assert resumed.step(p, c, trained=False, time_generate_s=0.5, time_train_s=0.5) == m2
  fresh = Ledger(fc, use_reference=True, use_value=True, remat="full", fused_head=True, **kw)
  fresh.load_state_dict(None)  # a checkpoint written before the ledger
  assert fresh.state_dict() == {"flops_total": 0, "samples_total": 0, "tokens_total": 0, "device_s_total": 0.0}


def test_provenance_names_the_commit_and_the_libraries():
  import subprocess

  import flax

  record = provenance()
  assert record["libraries"]["jax"] == jax.__version__ and record["libraries"]["flax"] == flax.__version__
  head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False).stdout.strip()
  if head:  # a checkout (CI clones one): the commit is HEAD's, and the dirty flag is a bool
    assert record["code"]["commit"] == head and isinstance(record["code"]["dirty"], bool)
