import sys

from mmtok.cli import main

sys.exit(main())
