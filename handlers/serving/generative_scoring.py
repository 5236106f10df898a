"""vLLM's `POST /generative_scoring`: for each item, one greedy step of the generative
model on query + item (or item + query) with `logprob_token_ids` = the labels, and the
first label's probability as the score, renormalised over the labels (`apply_softmax`)
or over the whole vocabulary. The labels' logprobs are those of the step's
distribution, as `logprob_token_ids` reports them on chat."""

from __future__ import annotations

import math

from handlers.protocol.generative_scoring import GenerativeScoringRequest
from handlers.protocol.sampling import SamplingBounds, make_sampling_params
from handlers.protocol.score import ScoreData, ScoreResponse
from handlers.serving.base import PromptInput, ServingBase
from handlers.serving.choice import ChoiceOptions
from handlers.serving.context import RequestContext
from handlers.serving.served_model import offloads


class ServingGenerativeScoring(ServingBase):
    kind = "generative_scoring"
    id_prefix = "generative-scoring"

    async def create(self, request: GenerativeScoringRequest, ctx: RequestContext) -> ScoreResponse:
        model_name = self.model_name(request.model)
        served = self.served
        labels = request.label_token_ids
        served.check_token_ids(labels, "label_token_ids")
        if isinstance(request.query, str):
            query = await served.encode(
                request.query, add_special_tokens=request.add_special_tokens, param="query"
            )
        else:
            served.check_token_ids(request.query, "query")
            query = list(request.query)
        prompts = []
        offload = offloads(request.items)
        for i, item in enumerate(request.items):
            param = f"items[{i}]"
            if isinstance(item, str):
                ids = await served.encode(
                    item, add_special_tokens=False, param=param, offload=offload
                )
            else:
                served.check_token_ids(item, param)
                ids = list(item)
            prompts.append(PromptInput(ids + query if request.item_first else query + ids, param))

        def params(bounds: SamplingBounds):
            return make_sampling_params(
                max_tokens=1,
                vocab_size=bounds.vocab_size,
                temperature=0.0,
                logprobs=len(labels),
                logprob_token_ids=labels,
            )

        run = await self.start_run(
            ctx,
            model_name=model_name,
            prompts=prompts,
            build_params=params,
            options=ChoiceOptions(),
            client_request_id=request.request_id,
            priority=request.priority,
            cache_salt=request.cache_salt,
        )
        await self.collect(run)
        data = []
        for i, seq in enumerate(run.sequences):
            label_logprobs = [logprob for _, logprob in seq.logprobs[0].top]
            data.append(ScoreData(index=i, score=_first_label_probability(
                label_logprobs, renormalise=request.apply_softmax
            )))  # fmt: skip
        return ScoreResponse(**self.envelope(run), data=data)


def _first_label_probability(logprobs: list[float], *, renormalise: bool) -> float:
    if not renormalise:
        return math.exp(logprobs[0])
    top = max(logprobs)
    if top == -math.inf:
        return 0.0
    weights = [math.exp(lp - top) for lp in logprobs]
    return weights[0] / sum(weights)
