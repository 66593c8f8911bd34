"""What the worker scripts beside this file share: how a rank hands its results to the test."""

import json
import os


def report(data):
    """Write this rank's results where the test looks (RESULT_DIR), else print them."""
    text = json.dumps(data)
    if os.environ.get("RESULT_DIR"):
        with open(os.path.join(os.environ["RESULT_DIR"], f"rank{data['rank']}.json"), "w") as f:
            f.write(text)
    else:
        print("RESULT " + text, flush=True)
