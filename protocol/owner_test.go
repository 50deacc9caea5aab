package protocol

import (
	"strings"
	"testing"
)

func TestSplitOwner(t *testing.T) {
	for in, want := range map[string]struct {
		uid  uint32
		rest string
		ok   bool
	}{
		"0:x":                 {0, "x", true},
		"65534:model/w":       {65534, "model/w", true},
		"4294967295:a:b":      {4294967295, "a:b", true},
		"4294967296:x":        {0, "4294967296:x", false},
		"007:x":               {0, "007:x", false},
		"model:v1":            {0, "model:v1", false},
		"12:":                 {0, "12:", false},
		":x":                  {0, ":x", false},
		"x":                   {0, "x", false},
		"12345678901:x":       {0, "12345678901:x", false},
		"1a:x":                {0, "1a:x", false},
		QualifiedName(7, "n"): {7, "n", true},
	} {
		uid, rest, ok := SplitOwner(in)
		if uid != want.uid || rest != want.rest || ok != want.ok {
			t.Errorf("SplitOwner(%q) = %d, %q, %v; want %v", in, uid, rest, ok, want)
		}
	}
	long := strings.Repeat("n", MaxNameLen)
	if err := ValidateName("4294967295:" + long); err != nil {
		t.Errorf("a qualified name with a %d-byte rest: %v", MaxNameLen, err)
	}
	if err := ValidateName("1:" + long + "n"); err == nil {
		t.Error("a qualified name whose rest is too long was accepted")
	}
	if err := ValidateName("model:" + long); err == nil {
		t.Error("a long unqualified name was accepted")
	}
}
