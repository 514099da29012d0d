"""Play episodes on a server with openenv-core's own client; print what it saw as JSON lines.

Usage: python play_with_openenv_client.py URL SEED MOVE [MOVE ...]
"""

from __future__ import annotations

import json
import sys

from openenv.core import GenericEnvClient


def main() -> None:
    url, seed, moves = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    with GenericEnvClient(base_url=url).sync() as env:
        first = env.reset(seed=seed)
        print(json.dumps({"observation": first.observation, "reward": first.reward, "done": first.done}))
        for move in moves:
            r = env.step({"message": move})
            print(json.dumps({"observation": r.observation, "reward": r.reward, "done": r.done}))
        print(json.dumps({"state": env.state()}))


if __name__ == "__main__":
    main()
