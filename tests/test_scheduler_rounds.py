"""The coordinator's round loop (``coordinator.scheduler.Scheduler``) run in-process against real draft and target
services, with the kind of each round scripted instead of measured: what the draft hears, and what the batch
keeps, when sequences finish in rounds that skip the draft."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence

from hf_oracle import greedy
from test_e2e_greedy import prompts

from coordinator.discovery import StaticDiscovery
from coordinator.draft_length import DraftLength
from coordinator.model_clients import connect
from coordinator.replicas import ReplicaPool
from coordinator.request import Request, new_samples
from coordinator.scheduler import Scheduler, SchedulerConfig
from coordinator.text import TextCodec
from coordinator.validation import GenerationSpec
from engine.sampling import SamplingParams
from serving.tls import TLSFiles


class ScriptedRounds(DraftLength):
    """A fixed k whose rounds follow ``script`` (cycled; the first kind available where the scripted one is not)
    instead of a speculation gate's measurements; notes each round's kind, the sequences its batch keeps and
    the tokens it counts against ``--max-batch-tokens``."""

    def __init__(self, script: Sequence[str]) -> None:
        super().__init__(4, 4, adaptive=False)
        self._script = itertools.cycle(script)
        self.scheduler: Scheduler | None = None
        self.kinds: list[str] = []
        self.kept: list[int] = []
        self.batch_tokens: list[int] = []

    def for_round(self, kinds: Sequence[str] = ("draft", "plain"), sampled: bool = False, sequences: int = 1
                  ) -> tuple[str, int]:
        scripted = next(self._script)
        kind = scripted if scripted in kinds else kinds[0]
        self.kinds.append(kind)
        self.kept.append(len(self.scheduler._samples))
        self.batch_tokens.append(self.scheduler._batch_tokens)
        return kind, self.k if kind == "draft" else 0


async def _run(target_address: str, draft_address: str, script: Sequence[str],
               jobs: Sequence[tuple[list[int], int, int]]) -> tuple[list[Request], Scheduler, ScriptedRounds]:
    """Serve ``jobs`` (prompt, n, max_new_tokens; greedy) in one batch. Returns the requests, the scheduler and
    its rounds."""
    tls = TLSFiles()
    target = await connect(target_address, "target", tls, 30)
    drafts = ReplicaPool("draft", StaticDiscovery([draft_address]), tls)
    await drafts.refresh()
    rounds = ScriptedRounds(script)
    scheduler = rounds.scheduler = Scheduler(target, drafts, rounds, SchedulerConfig(probe_period_s=0.05),
                                             reroute=lambda r, s: False)
    ids = itertools.count(1)
    requests = []
    for prompt, n, max_new in jobs:
        spec = GenerationSpec(prompt_token_ids=prompt, n=n, max_new_tokens=max_new, sampling=SamplingParams(),
                              stop=[], ignore_eos=True)
        requests.append(Request(spec=spec, group_id=next(ids), samples=new_samples(spec, lambda: next(ids),
                                                                                     frozenset(), TextCodec("")),
                                stream=False))
    for request in requests:
        scheduler.enqueue(request)
    loop = asyncio.create_task(scheduler.run())
    try:
        await asyncio.wait_for(asyncio.gather(*(r.done.wait() for r in requests)), 120)
    finally:
        loop.cancel()
        await target.close()
        for endpoint in drafts.endpoints.values():
            await endpoint.close()
    return requests, scheduler, rounds


def test_sequences_finishing_in_rounds_without_the_draft_are_released_there_later(deployments, checkpoints):
    """A short request finishes in a lookup round (no Propose): the draft hears of it in the next draft round, so
    that round succeeds and the draft stays with the batch (it was dropped and re-prefilled before). The batch
    also forgets a finished request's sequences, and its tokens, while the others run on (a request whose
    samples finish together counts once). Output stays HF greedy's."""
    deployment = deployments("llama", "llama")
    jobs = [(prompts()[2], 2, 6), (prompts()[3], 1, 7), (prompts()[1], 1, 48)]
    requests, scheduler, rounds = asyncio.run(_run(
        deployment.servers["target"].address, deployment.servers["draft"].address,
        ["draft", "lookup", "lookup", "lookup"], jobs))
    for request, (prompt, n, max_new) in zip(requests, jobs, strict=True):
        assert request.error is None
        expected = greedy(checkpoints["llama"], prompt, max_new, None)
        assert [s.token_ids for s in request.samples] == [expected] * n
    # every scripted draft round ran as one (a failed Propose falls back to lookup, then the draft re-joins)
    long = requests[2].usage
    assert long.rounds == len(rounds.kinds) and rounds.kinds.count("draft") > 2
    assert long.rounds - long.lookup_rounds - long.plain_rounds == rounds.kinds.count("draft")
    assert long.draft_tokens_accepted == long.draft_tokens_proposed > 0  # the draft is the target: full context
    assert scheduler.draft is not None and scheduler.draft.healthy
    # once the short requests are done only the long one's sequence is kept
    assert rounds.kept[0] == 4 and rounds.kept[-1] == 1
    assert rounds.batch_tokens[0] == sum(Scheduler._tokens(r) for r in requests)
    assert rounds.batch_tokens[-1] == Scheduler._tokens(requests[2])
