import os
import sys

# The spawned ranks import `tests.scenarios`: keep the repository root importable.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
# The tests' models are small: their optimizer steps are chunked as finely as a large
# model's would be (see step_chunks.py), so that the chunked step stays
# covered; test_schedules checks the default.
os.environ["FGPSDP_STEP_CHUNK_MIN_ELEMENTS"] = "1"
