import sys
from pathlib import Path

# the multiprocess harness and worker scenarios are plain modules next to the tests
sys.path.insert(0, str(Path(__file__).parent))
