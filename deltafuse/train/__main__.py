from deltafuse.train.cli import main

raise SystemExit(main())
