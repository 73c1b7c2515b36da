#!/usr/bin/env python3
"""Talks to a running `difftx serve` through the official OpenAI Python client (pip install openai).

    difftx serve --model runs/demo --port 8080 &
    python scripts/openai_client_check.py --base-url http://127.0.0.1:8080/v1

Checks completions and chat, whole and streamed (the streamed text must equal the whole text
for the same seed), the model list, and that a bad request raises the client's error class.
Prints one line per check and exits non-zero on the first failure.
"""
import argparse
import sys

import openai


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    ap.add_argument("--api-key", default="none", help="the server's --api-key, if it has one")
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    print(f"openai {openai.__version__}")

    model = client.models.list().data[0].id
    print(f"models: {model}")

    whole = client.completions.create(model=model, prompt="ROMEO:", max_tokens=40, seed=1, temperature=0.8)
    text = whole.choices[0].text
    print(f"completion ({whole.usage.completion_tokens} tokens, {whole.choices[0].finish_reason}): {text!r}")
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model=model, prompt="ROMEO:", max_tokens=40, seed=1, temperature=0.8, stream=True)
        if c.choices
    )
    assert streamed == text, f"streamed completion differs: {streamed!r}"
    print("streamed completion: same text")

    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Who art thou?"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=40, seed=2)
    answer = chat.choices[0].message.content
    print(f"chat ({chat.usage.prompt_tokens} prompt tokens, {chat.choices[0].finish_reason}): {answer!r}")
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(model=model, messages=messages, max_tokens=40, seed=2, stream=True)
        if c.choices
    )
    assert streamed == answer, f"streamed chat differs: {streamed!r}"
    print("streamed chat: same text")

    try:
        client.completions.create(model=model, prompt="x", max_tokens=10**9)
    except openai.UnprocessableEntityError as e:
        print(f"max_tokens too large: {e.status_code} {e.body['message'] if isinstance(e.body, dict) else e.body}")
    else:
        sys.exit("a max_tokens beyond the limit was accepted")
    print("all checks passed")


if __name__ == "__main__":
    main()
