"""shmvec in verl: ``ShmvecAgentLoop.run()`` of the real verl package (0.9.1) on the CPU,
against a fake server manager returning ``TokenOutput``s, with a tokenizer trained at
test time: 256 concurrent trajectories with env errors and a killed worker among them;
ids appended turn by turn (never re-rendered), masks and log-probabilities consistent,
failures raised only in their own ``run()``, every trajectory replayable alone."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

verl_agent_loop = pytest.importorskip(
    "verl.experimental.agent_loop.agent_loop",
    reason="verl is not installed (pip install 'shmvec[verl]', with torch's CPU build first)",
)
pytest.importorskip("tokenizers", reason="tokenizers is not installed (verl brings it)")

import hydra  # noqa: E402
from awaitable_envs import GuessTextEnv  # noqa: E402
from chat_tokenizer import chatml_tokenizer  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from verl.workers.rollout.replica import TokenOutput  # noqa: E402

import shmvec  # noqa: E402
from shmvec import EnvStepError, EnvWorkerDiedError  # noqa: E402
from shmvec.integrations import verl as shmvec_verl  # noqa: E402

pytestmark = pytest.mark.timeout(240)

RESPONSE_LENGTH = 400


class FakeServer:
    """verl's server manager: ``generate`` answers a guess ("I say N" + ``<|im_end|>``,
    or a length stop without it) with made-up log-probabilities, after a random pause;
    it records every call."""

    def __init__(self, tokenizer, seed):
        self.tokenizer, self.rng = tokenizer, random.Random(seed)
        self.calls: dict[str, list[tuple[list[int], list[int], list[float]]]] = {}

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        assert sampling_params == {"temperature": 1.0}
        await asyncio.sleep(self.rng.random() * 0.005)
        text = f"I say {self.rng.randint(1, 9)}"
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if self.rng.random() < 0.9:
            ids.append(self.tokenizer.eos_token_id)  # else a length stop: no end-of-turn
        logprobs = [-round(self.rng.random() + 0.01, 6) for _ in ids]
        self.calls.setdefault(request_id, []).append((list(prompt_ids), ids, logprobs))
        return TokenOutput(token_ids=ids, log_probs=logprobs, stop_reason="completed")


def make_loop(server, tokenizer, **kwargs):
    """The agent loop as verl's AgentLoopWorker makes it: hydra, from the registry entry
    plus the agent loop config's keys."""
    config = OmegaConf.create(
        {"actor_rollout_ref": {"rollout": {
            "prompt_length": 512, "response_length": RESPONSE_LENGTH,
            "multi_turn": {"max_assistant_turns": None},
        }}, "data": {"apply_chat_template_kwargs": {}}}
    )  # fmt: skip
    entry = {**verl_agent_loop._agent_loop_registry["shmvec_env"], **kwargs}
    return hydra.utils.instantiate(
        config=entry,
        trainer_config=verl_agent_loop.DictConfigWrap(config=config),
        server_manager=server,
        tokenizer=tokenizer,
        processor=None,
        hf_model_type=None,
        dataset_cls=None,
        data_config=verl_agent_loop.DictConfigWrap(config.data),
        tools=verl_agent_loop.ToolListWrap([]),
    )


SYSTEM = [{"role": "system", "content": "You are a player of guessing games."}]


def check_output(output, calls, tokenizer, seed, options):
    """The trajectory's ids, mask and log-probabilities against the server's calls."""
    prompt, response = output.prompt_ids, output.response_ids
    mask, logprobs = output.response_mask, output.response_logprobs
    assert len(mask) == len(response) == len(logprobs) <= RESPONSE_LENGTH
    # Each call's prompt is the previous prompt + its ids + appended ids: no re-rendering.
    assert calls[0][0] == prompt
    for (before, ids, _), (after, _, _) in zip(calls, calls[1:]):
        assert after[: len(before) + len(ids)] == before + ids
    sequence = prompt + response
    last_prompt, last_ids, _ = calls[-1]
    assert sequence[: len(last_prompt) + len(last_ids)] == last_prompt + last_ids
    # Mask 1 exactly on the generated ids, with their log-probabilities; 0.0 elsewhere.
    expected_mask, expected_lp = [], []
    for k, (before, ids, lps) in enumerate(calls):
        end = len(calls[k + 1][0]) if k + 1 < len(calls) else len(sequence)
        appended = end - len(before) - len(ids)
        expected_mask += [1] * len(ids) + [0] * appended
        expected_lp += lps + [0.0] * appended
    assert mask == expected_mask[: len(mask)] and logprobs == expected_lp[: len(logprobs)]
    # Decoded, the ids are the chat the template renders: the newline after <|im_end|>.
    traj = output.extra_fields["env_trajectory"]
    messages = [*SYSTEM, {"role": "user", "content": traj.observations[0]}]
    for (_, ids, _), obs in zip(calls, traj.observations[1:]):
        messages.append(
            {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
        )  # noqa: E501
        messages.append({"role": "user", "content": obs})
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    decoded = tokenizer.decode(sequence, skip_special_tokens=False)
    assert rendered.startswith(decoded), (decoded, rendered)
    assert "<|im_end|><|im_start|>" not in decoded
    # The env's own episode, replayed alone, bit for bit.
    assert traj.seed == seed and traj.options == options
    shmvec.rollouts.replay(traj, GuessTextEnv)
    assert output.reward_score == sum(traj.rewards)


def test_256_concurrent_runs_with_env_errors_and_a_killed_worker():
    seed0 = random.randrange(2**31)
    rng = random.Random(seed0)
    tokenizer = chatml_tokenizer()
    server = FakeServer(tokenizer, seed0)
    rows = []
    for k in range(256):
        options = {"wait_s": 0.002}
        if rng.random() < 0.05:
            options["fail_at"] = rng.randint(1, 2)
        rows.append({"raw_prompt": SYSTEM, "extra_info": {"seed": seed0 + k, "options": options}})
    killer = rng.randrange(64, 256)  # a row that kills its env's worker at its first step
    rows[killer]["extra_info"]["options"] = {"die_at": 1}

    async def one(row):
        loop = make_loop(server, tokenizer, envs="awaitable_envs:guess_envs")
        return await loop.run({"temperature": 1.0}, **row)

    async def main():
        return await asyncio.gather(*(one(row) for row in rows), return_exceptions=True)

    try:
        outputs = asyncio.run(main())
    finally:
        shmvec_verl.close_env_pools()
    assert len(server.calls) == 256
    died_envs = set()
    for k, (row, output) in enumerate(zip(rows, outputs)):
        options = row["extra_info"]["options"]
        if isinstance(output, BaseException):
            assert isinstance(output, (EnvStepError, EnvWorkerDiedError)), (seed0, k, output)
            if isinstance(output, EnvStepError):
                assert "fail_at" in options, (seed0, k, output)
            else:
                died_envs.add(output.env_id)
            continue
        # A row asked to fail ends before its faulty step, or fails.
        actions = output.extra_fields["env_trajectory"].actions
        assert len(actions) < options.get("fail_at", 99), (seed0, k)
        calls = server.calls[output.extra_fields["request_id"]]
        check_output(output, calls, tokenizer, seed0 + k, options)
    # The failures are the rows' own: the killer row, and rows whose env shared its worker.
    assert isinstance(outputs[killer], EnvWorkerDiedError), (seed0, outputs[killer])
    worker = outputs[killer].env_id // 8
    assert {env // 8 for env in died_envs} == {worker}, (seed0, died_envs)
    ok = [k for k, o in enumerate(outputs) if not isinstance(o, BaseException)]
    assert len(ok) >= 200, (seed0, len(ok))


def test_max_retries_runs_a_failed_trajectory_again_then_raises():
    tokenizer = chatml_tokenizer()
    server = FakeServer(tokenizer, 0)
    row = {"raw_prompt": SYSTEM, "extra_info": {"seed": 1, "options": {"fail_at": 1}}}

    async def main():
        loop = make_loop(server, tokenizer, envs="awaitable_envs:guess_envs", max_retries=2)
        return await loop.run({"temperature": 1.0}, **row)

    try:
        with pytest.raises(EnvStepError, match="scripted fault at step 1"):
            asyncio.run(main())
    finally:
        shmvec_verl.close_env_pools()
    assert len(server.calls) == 3, "the first run and two retries, each with its own request"


def test_bad_configuration_and_rows_get_clear_errors():
    tokenizer = chatml_tokenizer()
    server = FakeServer(tokenizer, 0)
    with pytest.raises(Exception, match="needs envs="):  # hydra wraps it
        make_loop(server, tokenizer)

    async def main(envs, row):
        loop = make_loop(server, tokenizer, envs=envs)
        return await loop.run({"temperature": 1.0}, **row)

    try:
        with pytest.raises(ValueError, match="no env has tag 'chess'"):
            asyncio.run(main("awaitable_envs:guess_envs", {"env_tag": "chess"}))
        with pytest.raises(ValueError, match="has no callable 'nothing_here'"):
            asyncio.run(main("awaitable_envs:nothing_here", {}))
    finally:
        shmvec_verl.close_env_pools()


def test_without_logprobs_and_with_max_turns():
    tokenizer = chatml_tokenizer()

    class NoLogprobs(FakeServer):
        async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
            output = await super().generate(
                request_id, prompt_ids=prompt_ids, sampling_params=sampling_params
            )
            return TokenOutput(token_ids=output.token_ids, log_probs=None)

    server = NoLogprobs(tokenizer, 3)
    rows = [{"raw_prompt": SYSTEM, "extra_info": {"seed": s}} for s in range(8)]

    async def main():
        loop = make_loop(server, tokenizer, envs="awaitable_envs:guess_envs", max_turns=2)
        return await asyncio.gather(*(loop.run({"temperature": 1.0}, **row) for row in rows))

    try:
        outputs = asyncio.run(main())
    finally:
        shmvec_verl.close_env_pools()
    for output in outputs:
        calls = server.calls[output.extra_fields["request_id"]]
        assert output.response_logprobs is None
        assert len(output.response_mask) == len(output.response_ids)
        assert sum(output.response_mask) == sum(len(ids) for _, ids, _ in calls)
        assert len(calls) <= 2
        ended = output.extra_fields["env_ended"]
        assert ended in ("terminated", "max_turns"), ended
        assert (ended == "max_turns") == (len(calls) == 2 and output.reward_score == 0.0)


def test_a_fast_trajectory_does_not_wait_for_a_slow_env_beside_it():
    """One row's env steps 4 s a turn; rows that start beside it and step in 1 ms finish
    at their own pace (before, each result waited in a slot for the slow step)."""
    slow_s = 4.0
    tokenizer = chatml_tokenizer()
    server = FakeServer(tokenizer, 0)

    async def one(k, wait_s, after_s):
        await asyncio.sleep(after_s)
        loop = make_loop(server, tokenizer, envs="awaitable_envs:guess_envs")
        row = {"raw_prompt": SYSTEM, "extra_info": {"seed": k, "options": {"wait_s": wait_s}}}
        started = time.perf_counter()
        await loop.run({"temperature": 1.0}, **row)
        return time.perf_counter() - started

    async def main():
        slow = asyncio.ensure_future(one(0, slow_s, 0.0))
        # One row at a time beside the slow one: with the env's batch_size=2, each of its
        # results and the slow env's would make a batch.
        fast = [await one(k, 0.001, 0.2) for k in range(1, 5)]
        return await slow, fast

    try:
        slow, fast = asyncio.run(main())
    finally:
        shmvec_verl.close_env_pools()
    assert slow >= slow_s
    assert sum(fast) < slow_s / 2, fast


class DigitLoop(shmvec_verl.ShmvecAgentLoop):
    """The agent loop whose action is the first digit of the model's text."""

    def action_of(self, text):
        return "".join(c for c in text if c.isdigit())[:1]


def test_an_action_outside_the_space_ends_its_trajectory_as_invalid_action():
    """The model's text is not one digit: the trajectory ends there as ``invalid_action``
    (its ids kept, the reason naming the action and the space); with ``action_of`` taking
    the digit out of the text, the same replies are moves."""
    tokenizer = chatml_tokenizer()
    rows = [{"raw_prompt": SYSTEM, "extra_info": {"seed": s}} for s in range(4)]

    async def main(**kwargs):
        loop = make_loop(server, tokenizer, envs="awaitable_envs:digit_guess_envs", **kwargs)
        return await asyncio.gather(*(loop.run({"temperature": 1.0}, **row) for row in rows))

    try:
        server = FakeServer(tokenizer, 5)
        outputs = asyncio.run(main())
        for output in outputs:
            traj = output.extra_fields["env_trajectory"]
            assert output.extra_fields["env_ended"] == "invalid_action"
            assert traj.status is shmvec.rollouts.Status.INVALID_ACTION and not traj.actions
            assert "is outside the env's action space Text(1, 1" in traj.reason, traj.reason
            assert sum(output.response_mask) == len(output.response_ids) > 0
        shmvec_verl.close_env_pools()  # a pool serves one event loop
        server = FakeServer(tokenizer, 5)
        outputs = asyncio.run(main(_target_=f"{__name__}.DigitLoop"))
        for output in outputs:
            assert output.extra_fields["env_ended"] in ("terminated", "truncated")
            assert output.extra_fields["env_trajectory"].actions
    finally:
        shmvec_verl.close_env_pools()
