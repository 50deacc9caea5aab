package cudaipc

import (
	"os"
	"strings"
	"testing"
)

// TestGatherPTXMatchesPython: the Go and Python clients launch the same
// gather kernel; the Python package carries its own copy of the PTX (it is
// installed apart from this module), so the two copies are checked here.
func TestGatherPTXMatchesPython(t *testing.T) {
	src, err := os.ReadFile("python/cudaipc/_gather.py")
	if err != nil {
		t.Fatal(err)
	}
	s := string(src)
	const open = `_PTX = r"""`
	i := strings.Index(s, open)
	if i < 0 {
		t.Fatalf("python/cudaipc/_gather.py has no %s", open)
	}
	s = s[i+len(open):]
	j := strings.Index(s, `"""`)
	if j < 0 {
		t.Fatal("python/cudaipc/_gather.py: _PTX is not closed")
	}
	py := strings.TrimSpace(s[:j])
	if py != strings.TrimSpace(gatherPTX) {
		t.Fatal("gatherPTX (gather.go) and _PTX (python/cudaipc/_gather.py) differ: change both together")
	}
}
