"""Serving benchmark against any OpenAI-compatible endpoint; see tokenmill/bench/serve_command.py.

    python benchmarks/serve.py --launch          # tokenmill serve on SmolLM2, sweep 1,4,16,64
    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --request-rate 2
"""

from tokenmill.bench.serve_command import main

if __name__ == "__main__":
    raise SystemExit(main())
