package testutil

import (
	"bytes"
	"encoding/json"
	"os"
	"testing"
)

// CheckVectorFile checks a file of shared test vectors, which the Python
// client's tests read too, against v, what the code writes now as indented
// JSON: with update (a package's -update flag) it first rewrites the file
// from v; then it fails the test unless the file holds exactly those bytes,
// and decodes the file into out.
func CheckVectorFile(t testing.TB, path string, update bool, v, out any) {
	t.Helper()
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	b = append(b, '\n')
	if update {
		if err := os.WriteFile(path, b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got, err := os.ReadFile(path)
	if err != nil || !bytes.Equal(got, b) {
		t.Fatalf("%s differs from what the code writes (%v); run go test -run %s -update and review the diff", path, err, t.Name())
	}
	if err := json.Unmarshal(got, out); err != nil {
		t.Fatal(err)
	}
}
