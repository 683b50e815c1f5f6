from streamsync.cli import main

raise SystemExit(main())
