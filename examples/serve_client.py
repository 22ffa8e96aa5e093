"""Ask a running ``xfuse serve`` for an image with the ``openai`` package and save it.

    torchrun --nproc_per_node=2 -m xfuse serve --config configs/tiny/pp2.yaml      # in one terminal
    python examples/serve_client.py --prompt "a lighthouse at dusk" --seed 7        # in another

The diffusion fields (``seed``, ``num_inference_steps``, ``guidance_scale``, ``negative_prompt``) are not part of
OpenAI's own schema; the client sends them with ``extra_body``.
"""

import argparse
import base64
import os

import openai


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default=os.environ.get("XFUSE_API_KEY", "none"))
    parser.add_argument("--prompt", default="A small red fox in the snow, digital painting")
    parser.add_argument("--size", default="auto", help="WIDTHxHEIGHT, or auto for the server's default")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--output", default="outputs/served.png")
    args = parser.parse_args()

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    extra = {k: v for k, v in (("seed", args.seed), ("num_inference_steps", args.steps)) if v is not None}
    result = client.images.generate(prompt=args.prompt, size=args.size, response_format="b64_json", extra_body=extra)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "wb") as fh:
        fh.write(base64.b64decode(result.data[0].b64_json))
    timings = result.model_extra.get("timings", {})
    print(f"wrote {args.output} (seed {result.model_extra.get('seed')}, generation {timings.get('generation_s')} s)")


if __name__ == "__main__":
    main()
