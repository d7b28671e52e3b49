import os
import sys
from pathlib import Path

# Keep CPU tests quiet and reproducible on small machines.
os.environ.setdefault("OMP_NUM_THREADS", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent))
