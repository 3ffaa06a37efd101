from worker.main import main

raise SystemExit(main())
