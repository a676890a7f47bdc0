import sys
from pathlib import Path

# tests import their shared builders (models.py, …) as plain modules
sys.path.insert(0, str(Path(__file__).parent))
