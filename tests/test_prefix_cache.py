"""The prefix cache (decode/core/prefix_cache.py): which entry a prompt takes (the longest run of its first tokens an
entry holding the states it needs starts with), least-recently-used eviction within the byte budget, states merged
into an entry, an entry a longer one starts with dropped; and `decode serve` reporting the prompt tokens it reused
(OpenAI's usage.prompt_tokens_details), a finished request's answer included."""
import pytest
import torch

from decode.common.errors import UserError
from decode.core.hidden import HiddenStates
from decode.core.prefix_cache import PrefixCache


def kv(n: int, fill: float = 0.0, layers: int = 2) -> list[torch.Tensor]:
    return [torch.arange(n, dtype=torch.float32).repeat(3, 1)[:, :, None].expand(3, n, 4) + fill
            for _ in range(layers)]


def test_a_prompt_takes_the_longest_run_of_its_first_tokens_an_entry_starts_with():
    c = PrefixCache(2 ** 20)
    c.put([1, 2, 3], kv(3), kv(3))
    c.put([1, 2, 3, 4, 5], kv(5), kv(5), {"h": HiddenStates(torch.arange(5.0)[:, None], None)})
    assert c.longest([1, 2, 3, 4, 5, 6]).tokens == (1, 2, 3, 4, 5)  # the whole entry
    hit = c.longest([1, 2, 3, 4, 9])  # the first 4 of the longer entry's positions, as views
    assert hit.tokens == (1, 2, 3, 4) and hit.keys[0].shape == (3, 4, 4)
    assert torch.equal(hit.keys[1], kv(5)[1][:, :4]) and hit.states["h"].final.flatten().tolist() == [0, 1, 2, 3]
    assert c.longest([1, 2], needs=["h"]).tokens == (1, 2)
    assert c.longest([1, 2, 3, 7], needs=["g"]) is None  # no entry holds that state
    assert c.longest([2, 1]) is None and c.longest([]) is None
    assert c.reused_tokens == 5 + 4 + 2
    c.put([1, 2, 3], kv(3), kv(3), {"g": torch.zeros(3, 2)})  # the same tokens again: states merge
    assert c.longest([1, 2, 3, 7], needs=["g"]).tokens == (1, 2, 3) and len(c) == 2
    with pytest.raises(ValueError, match="3 positions"):
        c.put([1, 2, 3], kv(2), kv(2))


def test_an_entry_a_longer_one_starts_with_is_dropped_unless_it_holds_a_state_the_longer_lacks():
    c = PrefixCache(2 ** 20)
    c.put([1, 2, 3], kv(3), kv(3), {"h": torch.zeros(3, 2)})
    c.put([5, 6], kv(2), kv(2))
    size = c.nbytes
    c.put([1, 2, 3, 4, 5], kv(5), kv(5), {"h": torch.ones(5, 2)})  # a finished answer: its prompt's entry goes
    assert len(c) == 2 and c.longest([1, 2, 3, 9]).tokens == (1, 2, 3)
    assert c.longest([1, 2, 3, 9], needs=["h"]).states["h"].eq(1).all()  # the longer entry's first rows
    assert c.nbytes == size - entry_bytes(3, {"h": torch.zeros(3, 2)}) + entry_bytes(5, {"h": torch.ones(5, 2)})
    c.put([5, 6, 7], kv(3), kv(3), {"g": torch.zeros(3, 1)})  # holds every state of [5, 6] (none): it goes
    c.put([1, 2, 3, 4, 5, 6], kv(6), kv(6))  # lacks "h": the entry holding it stays
    assert len(c) == 3 and c.longest([1, 2, 3, 4, 5, 6, 7], needs=["h"]).tokens == (1, 2, 3, 4, 5)
    assert c.longest([1, 2, 3, 4, 5, 6, 7]).tokens == (1, 2, 3, 4, 5, 6)


def entry_bytes(n: int, states: dict) -> int:
    one = PrefixCache(2 ** 20)
    one.put(list(range(1, n + 1)), kv(n), kv(n), states)
    return one.nbytes


def test_least_recently_used_entries_leave_first_and_the_budget_holds():
    one = PrefixCache(2 ** 20)
    one.put([1, 2, 3], kv(3), kv(3))
    size = one.nbytes  # three positions' keys and values
    c = PrefixCache(2 * size)
    c.put([1, 2, 3], kv(3), kv(3))
    c.put([4, 5, 6], kv(3), kv(3))
    assert c.longest([1, 2, 3, 0]) is not None  # used: [4, 5, 6] is now the least recently used
    c.put([7, 8, 9], kv(3), kv(3))
    assert c.longest([4, 5, 6]) is None and c.longest([1, 2, 3]) is not None and c.longest([7, 8, 9]) is not None
    assert len(c) == 2 and c.nbytes == 2 * size <= c.max_bytes
    assert not c.put(list(range(10, 20)), kv(10), kv(10)) and len(c) == 2  # larger than the whole cache: not kept
    with pytest.raises(UserError, match=">= 0 bytes"):
        PrefixCache(-1)


def test_the_server_reports_the_prompt_tokens_it_reused(tiny_target_dir):
    from decode.commands.serve.command import RunningServer
    from helpers import SERVE_ARMS
    import openai

    msgs = [{"role": "user", "content": "Write a poem about the sea and the sky and the stars above them."}]
    for max_batch in ("1", "2"):
        with RunningServer(["--target", tiny_target_dir, "--arms", SERVE_ARMS, "--state-file", "none",
                            "--max-batch", max_batch, "--threads", "1"]) as s:
            assert "prefix cache: 512 MiB" in s.log.getvalue()
            c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
            a, b = (c.chat.completions.create(model=s.model, messages=msgs, max_tokens=8, temperature=0)
                    for _ in range(2))
            assert a.usage.prompt_tokens_details.cached_tokens == 0
            assert b.usage.prompt_tokens_details.cached_tokens == b.usage.prompt_tokens - 1  # all but the last
            assert b.choices[0].message.content == a.choices[0].message.content
            longer = msgs + [{"role": "assistant", "content": a.choices[0].message.content},
                             {"role": "user", "content": "Again."}]
            r = c.chat.completions.create(model=s.model, messages=longer, max_tokens=8, temperature=0)
            assert 0 < r.usage.prompt_tokens_details.cached_tokens < r.usage.prompt_tokens - 1
            # a finished request is kept with its answer: a prompt re-sending both (as token ids, so no
            # re-tokenisation of the answer's text intervenes) prefills only what follows them
            ids = list(range(3, 40))
            first = c.completions.create(model=s.model, prompt=ids, max_tokens=8, temperature=0,
                                         extra_body={"adaspec": {"return_token_ids": True}})
            answer = first.model_extra["adaspec"]["token_ids"]
            nxt = c.completions.create(model=s.model, prompt=ids + answer + [7, 8, 9], max_tokens=4, temperature=0)
            assert nxt.usage.prompt_tokens_details.cached_tokens == len(ids) + len(answer) - 1
    with RunningServer(["--target", tiny_target_dir, "--arms", SERVE_ARMS, "--state-file", "none",
                        "--max-batch", "1", "--threads", "1", "--prefix-cache-mib", "0"]) as s:
        assert "prefix cache: off" in s.log.getvalue()
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        for _ in range(2):
            r = c.chat.completions.create(model=s.model, messages=msgs, max_tokens=4, temperature=0)
            assert r.usage.prompt_tokens_details.cached_tokens == 0
    with pytest.raises(UserError, match="--prefix-cache-mib must be an integer >= 0"):
        RunningServer(["--target", tiny_target_dir, "--prefix-cache-mib", "-1"])


def test_bench_serve_conversations_send_every_turn_with_the_servers_answers(tiny_target_dir, tmp_path):
    """scripts/bench_serve.py ``--turns``: a suite row's later turns are its ``followups``, and each conversation
    sends them in order with the history so far, so the server finds the earlier turns (answers included) cached."""
    import sys
    from pathlib import Path

    from decode.commands.serve.command import RunningServer
    from decode.evaluation.suites import load_jsonl_suite
    from helpers import SERVE_ARMS

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from bench_serve import load

    suite = tmp_path / "q.jsonl"
    suite.write_text('{"question_id": 1, "category": "chat", "turns": ["Tell me about the sea.", "Shorter.", '
                     '"", "Again."]}\n{"question_id": 2, "category": "chat", "turns": ["One turn."]}\n')
    convo, single = load_jsonl_suite(suite)
    assert convo.followups == ("Shorter.", "Again.") and single.followups == ()  # empty turns are not sent
    with RunningServer(["--target", tiny_target_dir, "--arms", SERVE_ARMS, "--state-file", "none",
                        "--max-batch", "2", "--threads", "1"]) as s:
        r = load(s, [convo], 2, 1, 6, turns=True)
    assert r["errors"] == 0 and len(r["latencies"]) == 2 * 3  # two conversations of three turns, one at a time
    assert r["tokens"][0] == r["tokens"][1] and 3 <= len(r["tokens"][0]) <= 18  # greedy: the same conversation
    # the second conversation's three prompts were all seen (all but their last token); the first's later turns
    # re-send its earlier prompts and answers, its first turn nothing
    assert r["prompt_tokens"] // 2 - 3 < r["cached_tokens"] < r["prompt_tokens"] - 3
