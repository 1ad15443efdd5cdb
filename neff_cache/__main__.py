from neff_cache.cli import main

raise SystemExit(main())
