"""The harness the tests, benchmarks and calibration stand on: daemon processes (`daemons`),
shaped links between network namespaces (`netns`), benchmark text (`corpus`, WikiText-2 shipped
in `wikitext-2/`), quality measures (`quality`) and profile calibration (`calibrate`). The daemon
itself never imports this package."""
