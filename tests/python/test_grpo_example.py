"""examples/grpo_step.py for a few steps against the real server: the policy head trained on the
server moves towards the rewarded token, one version per optimizer step; the cloned reference head
stays frozen at its version."""
import importlib.util
from pathlib import Path

import lce_client
from conftest import server_binary

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_step.py"


def test_grpo_steps_train_the_policy_and_leave_the_reference(server_factory):
    spec = importlib.util.spec_from_file_location("grpo_step", EXAMPLE)
    grpo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(grpo)
    assert server_binary()
    srv = server_factory(["--seed-head=256x32", "--head-dtype=fp32", "--seed=5"], name="grpo")
    args = grpo.argparse.Namespace(steps=4, prompts=4, group=4, tokens=8, good_token=7, lr=2e-2, seed=1)
    out = grpo.run(lce_client.Client(srv.target, timeout=60), args)
    h = out["history"]
    assert [r["version"] for r in h] == [2, 3, 4, 5]
    assert h[-1]["good_logprob"] > h[0]["good_logprob"]
    assert out["ref_version_before"] == out["ref_version_after"] == 1
    assert all(r["kl_ref"] >= 0 for r in h)  # k3 is non-negative


def test_grpo_main_against_running_targets_says_what_it_ran_on(server_factory, capsys):
    """--target twice (the same server listed twice stands in for two replicas of one training job: the
    rollout scores spread over both and are pinned to the version just trained)."""
    spec = importlib.util.spec_from_file_location("grpo_step", EXAMPLE)
    grpo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(grpo)
    srv = server_factory(["--seed-head=256x32", "--head-dtype=fp32", "--seed=5"], name="grpo_main")
    out = grpo.main(["--target", srv.target, "--target", srv.target, "--steps", "3", "--prompts", "2", "--group",
                     "4", "--tokens", "8"])
    printed = capsys.readouterr().out
    assert f"running on:\n  {srv.target} (front): backend cpu, tp_size 1, head 'default' 256x32 fp32 version 1" \
        in printed, printed
    assert printed.count(srv.target) == 2, printed
    assert [r["version"] for r in out["history"]] == [2, 3, 4]
