"""``python -m hipengine``: the same CLI as the ``hipengine`` console script."""
import sys

from .cli import main

sys.exit(main())
