package testutil

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// TestCheckVectorFile: with update the file is written and decoded back;
// without, a file that differs from the code's vectors fails the test.
func TestCheckVectorFile(t *testing.T) {
	type vectors struct {
		Name  string  `json:"name"`
		Sizes []int64 `json:"sizes"`
	}
	path := filepath.Join(t.TempDir(), "vectors.json")
	want := vectors{"two", []int64{1, 1 << 40}}
	var got vectors
	CheckVectorFile(t, path, true, want, &got)
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("decoded %+v, want %+v", got, want)
	}
	CheckVectorFile(t, path, false, want, &got)
	b, err := os.ReadFile(path)
	if err != nil || !bytes.HasSuffix(b, []byte("}\n")) || !bytes.Contains(b, []byte("\n  \"sizes\": [\n")) {
		t.Fatalf("file %q, %v: want indented JSON ending in a newline", b, err)
	}
	if err := os.WriteFile(path, bytes.Replace(b, []byte("two"), []byte("tw0"), 1), 0o644); err != nil {
		t.Fatal(err)
	}
	ft := &fatalTB{TB: t}
	func() {
		defer func() { recover() }()
		CheckVectorFile(ft, path, false, want, &got)
	}()
	if !strings.Contains(ft.msg, "differs from what the code writes") {
		t.Errorf("a changed file: %q, want it to fail as differing", ft.msg)
	}
}

// fatalTB records a Fatalf and stops the caller by panicking.
type fatalTB struct {
	testing.TB
	msg string
}

func (f *fatalTB) Helper() {}

func (f *fatalTB) Fatalf(format string, args ...any) {
	f.msg = fmt.Sprintf(format, args...)
	panic(f.msg)
}
