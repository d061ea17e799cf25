"""Structured output through the real `openai` client against a live server (the default model):
json_schema strict on 20 varied prompts, greedy and sampled, parses and validates every time;
json_object, vLLM's structured_outputs / guided_* on chat and completions; n > 1, streaming, merged
identical requests and `--speculative ngram` give the same tokens as a lone plain request; LangChain's
with_structured_output."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from server_support import metrics

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance", reason="llguidance (structured output) is not installed")

MODEL = "smollm2-135m"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                         "country": {"type": "string", "maxLength": 16},
                                         "population_millions": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["city", "country", "population_millions"], "additionalProperties": False}
REVIEW = {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                                           "score": {"type": "integer", "minimum": 1, "maximum": 5},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                                    "maxItems": 2}},
          "required": ["sentiment", "score", "tags"], "additionalProperties": False}
TODO = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 20}, "done": {"type": "boolean"},
                                         "priority": {"enum": ["low", "medium", "high"]}},
        "required": ["title", "done", "priority"], "additionalProperties": False}
SCHEMAS = {"person": PERSON, "city": CITY, "review": REVIEW, "todo": TODO}
PROMPTS = [
    ("person", "Invent a fictional person."), ("person", "Who wrote Hamlet? Give name and age at death."),
    ("person", "Describe a child."), ("person", "Describe your grandmother."), ("person", "A famous scientist."),
    ("city", "Tell me about Paris."), ("city", "The capital of Japan."), ("city", "A city in Brazil."),
    ("city", "The largest city in Africa."), ("city", "Where is the Eiffel Tower?"),
    ("review", "Review: the food was cold and late."), ("review", "Review: best phone I ever owned!"),
    ("review", "Review: it works, nothing special."), ("review", "Review: terrible customer service."),
    ("review", "Review: lovely hotel with a view."),
    ("todo", "Remind me to buy milk."), ("todo", "I finished the report."), ("todo", "Urgent: call the bank."),
    ("todo", "Plan a trip to Rome someday."), ("todo", "Water the plants."),
]


def _format(kind: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": kind, "schema": SCHEMAS[kind], "strict": True}}


def _ask(client, kind: str, prompt: str, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                          response_format=_format(kind), max_tokens=kw.pop("max_tokens", 56), **kw)


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "top_p": 0.95, "seed": 7}],
                         ids=["greedy", "sampled"])
def test_json_schema_strict_on_20_prompts_always_validates(client, sampling):
    with ThreadPoolExecutor(8) as pool:   # in flight together: the engine batches them
        answers = list(pool.map(lambda p: _ask(client, p[0], p[1], **sampling), PROMPTS))
    for (kind, prompt), r in zip(PROMPTS, answers):
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (prompt, choice)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[kind])


def test_json_object_and_n_choices(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A cat, as JSON."}],
                                       response_format={"type": "json_object"}, max_tokens=40, temperature=0)
    c = r.choices[0]
    assert c.message.content.startswith("{")
    if c.finish_reason == "stop":   # else cut by max_tokens: still a prefix of an object
        assert isinstance(json.loads(c.message.content), dict)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Describe a person."}],
                                       response_format=_format("person"), max_tokens=56, n=3, temperature=1.0)
    assert len(r.choices) == 3
    for c in r.choices:   # each choice follows its own grammar state
        jsonschema.validate(json.loads(c.message.content), PERSON)


def test_vllm_extras_on_completions_and_chat(client):
    r = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=8, temperature=0,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].text in ("yes", "no")
    r = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=12, temperature=0,
                                  extra_body={"guided_regex": "[0-9]{3}-[0-9]{4}"})
    assert r.choices[0].text[:3].isdigit() and r.choices[0].text[3] == "-" and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Pick a color."}],
                                       max_tokens=8, temperature=0,
                                       extra_body={"guided_grammar": 'root ::= "red" | "green" | "blue"'})
    assert r.choices[0].message.content in ("red", "green", "blue")
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Describe a person."}],
                                       max_tokens=60, temperature=0, extra_body={"guided_json": PERSON})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_streamed_answer_is_the_non_streamed_one(client):
    ref = _ask(client, "city", "Tell me about Rome.", temperature=0).choices[0].message.content
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me about Rome."}], response_format=_format("city"),
        max_tokens=60, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref
    jsonschema.validate(json.loads(ref), CITY)


def test_merged_identical_requests_give_the_lone_answer(client, server):
    """Identical constrained requests in flight together are computed once (request merging) and
    give what one request alone gives; the same prompt under another schema is not merged into them."""
    prompt = "Describe a famous painter."
    alone = _ask(client, "person", prompt, temperature=0).choices[0].message.content
    before = metrics(server).get("slipstream_merged_requests_total", 0.0)
    with ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(_ask, client, "person", prompt, temperature=0) for _ in range(3)]
        other = pool.submit(_ask, client, "todo", prompt, temperature=0)
        together = [f.result().choices[0].message.content for f in futs]
        other_answer = other.result().choices[0].message.content
    assert together == [alone] * 3
    jsonschema.validate(json.loads(other_answer), TODO)   # its own constraint, not the merged one's
    after = metrics(server).get("slipstream_merged_requests_total", 0.0)
    assert after - before >= 1, (before, after)


def test_speculative_ngram_gives_the_same_tokens(client, start_server):
    import openai

    spec = start_server("--exact", "--speculative", "ngram")
    prompts = [("city", "Repeat exactly: {\"city\":\"Lyon\",\"country\":\"France\",\"population_millions\":1}"),
               ("person", "Repeat exactly: {\"name\":\"Ada Lovelace\",\"age\":36}")]
    with openai.OpenAI(base_url=f"{spec.base_url}/v1", api_key="unused", max_retries=0, timeout=120) as c2:
        for kind, prompt in prompts:
            plain = _ask(client, kind, prompt, temperature=0, logprobs=True)
            fast = _ask(c2, kind, prompt, temperature=0, logprobs=True)
            assert [t.token for t in fast.choices[0].logprobs.content] == \
                [t.token for t in plain.choices[0].logprobs.content]
            assert fast.choices[0].message.content == plain.choices[0].message.content
            jsonschema.validate(json.loads(fast.choices[0].message.content), SCHEMAS[kind])
    m = metrics(spec.base_url)
    drafted = sum(v for k, v in m.items() if k.startswith("slipstream_spec_decode_num_draft_tokens_total"))
    assert drafted > 0, "speculation never ran"


def test_langchain_with_structured_output(server):
    lc = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=24)
        age: int = Field(ge=0, le=120)

    llm = lc.ChatOpenAI(model=MODEL, base_url=f"{server}/v1", api_key="unused", temperature=0, max_tokens=60,
                        max_retries=0)
    person = llm.with_structured_output(Person, method="json_schema", strict=True).invoke("Invent a person.")
    assert isinstance(person, Person) and person.name
