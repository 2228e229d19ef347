//go:build race

package harness

// raceEnabled: the harness itself was built with -race (E2E_RACE=follow builds the binaries
// the same way).
const raceEnabled = true
