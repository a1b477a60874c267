"""The harness the tests, benchmarks and calibration stand on: daemon processes (`daemons`),
shaped links between network namespaces (`netns`), benchmark text (`corpus`: WikiText-2 in
`wikitext-2/`, licence texts in `legal/`, Python source in `code/`, and the GNU Coreutils manual
in `manual/`, which nothing is tuned on), quality measures (`quality`) and profile calibration
(`calibrate`). The daemon itself never imports this package."""
