package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestCommitHash(t *testing.T) {
	for _, c := range []struct{ line, want string }{
		{"the stream loop, removed after cc987f9", "cc987f9"},
		{"(main at 3d0366e)", "3d0366e"},
		{"a UUID (\"GPU-5f1c2a3b-…\")", ""},
		{"the constant 0x1f2e3d4c5b", ""},
		{"deadbeef and facade are words", ""},
		{"1234567 is a number", ""},
		{"an identifier abc1234def_x", ""},
	} {
		if got := commitHash(c.line); got != c.want {
			t.Errorf("commitHash(%q) = %q, want %q", c.line, got, c.want)
		}
	}
}

func TestGoComments(t *testing.T) {
	dir := t.TempDir()
	t.Chdir(dir)
	write(t, "docs/a.md", "# A\n\n## Failure behaviour\n\n**Known crashes.** text\n")
	write(t, "p/p.go", `// Package p is a test.
package p

// F does it (issue 19), measured 2026-12-01 at 3d0366e; see
// docs/a.md, "Failure
// behaviour", and docs/a.md, "Known crashes", and docs/a.md, "Gone".
func F() {}

// G cites docs/missing.md.
func G() {}
`)
	write(t, "p/p_test.go", `package p

// In tests history is allowed (issue 19, 3d0366e), broken references not:
// docs/a.md, "Gone too".
`)
	got := strings.Join(append(checkGo("p/p.go"), checkGo("p/p_test.go")...), "\n")
	for _, want := range []string{
		`p/p.go:4: comment cites an issue (issue 19)`,
		`p/p.go:4: comment cites a run date (2026-12-01)`,
		`p/p.go:4: comment cites a commit (3d0366e)`,
		`p/p.go:4: cites docs/a.md, "Gone"`,
		`p/p.go:9: names docs/missing.md: no such file`,
		`p/p_test.go:3: cites docs/a.md, "Gone too"`,
	} {
		if !strings.Contains(got, want) {
			t.Errorf("findings lack %q:\n%s", want, got)
		}
	}
	for _, unwanted := range []string{`"Failure behaviour"`, `"Known crashes"`, "p_test.go:3: comment cites"} {
		if strings.Contains(got, unwanted) {
			t.Errorf("findings have %s:\n%s", unwanted, got)
		}
	}
}

func TestMarkdownRefs(t *testing.T) {
	dir := t.TempDir()
	t.Chdir(dir)
	write(t, "docs/a.md", "# A\n\n## The store: round trip\n\ntext\n")
	write(t, "docs/lab/old.md", "As docs/a.md, \"Measured\" said then; [a](../a.md).\n")
	write(t, "README.md", strings.Join([]string{
		"[ok](docs/a.md) [anchor](docs/a.md#the-store-round-trip) [bad anchor](docs/a.md#measured)",
		"[gone](docs/gone.md) [web](https://example.com/x.md) docs/a.md, \"The store\" and docs/a.md, \"Measured\".",
	}, "\n"))
	got := strings.Join(append(checkRefs("README.md", false), checkRefs("docs/lab/old.md", false)...), "\n")
	for _, want := range []string{
		"README.md: link to docs/a.md#measured: docs/a.md has no such heading",
		"README.md: link to docs/gone.md: no such file",
		`README.md: cites docs/a.md, "Measured"`,
	} {
		if !strings.Contains(got, want) {
			t.Errorf("findings lack %q:\n%s", want, got)
		}
	}
	for _, unwanted := range []string{"the-store-round-trip", "example.com", `"The store"`, "docs/lab/old.md"} {
		if strings.Contains(got, unwanted) {
			t.Errorf("findings have %s:\n%s", unwanted, got)
		}
	}
}

func write(t *testing.T, name, text string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(name), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(name, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestSecretRecipes: a recipe that writes a secret from /dev/urandom makes
// its directory and writes it under umask 077, in this repository's docs
// too (they had it written readable before a chmod, into /etc/cudaipc,
// which a fresh machine lacks).
func TestSecretRecipes(t *testing.T) {
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	docs, _ := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	for _, f := range append(docs, filepath.Join(root, "README.md")) {
		for _, b := range checkSecretRecipes(f) {
			t.Error(b)
		}
	}
	dir := t.TempDir()
	t.Chdir(dir)
	write(t, "a.md", strings.Join([]string{
		"head -c 32 /dev/urandom | base64 > /etc/cudaipc/secret && chmod 600 /etc/cudaipc/secret",
		"(umask 077; mkdir -p /etc/cudaipc && head -c 32 /dev/urandom | base64 > /etc/cudaipc/secret)",
		"head -c 64M /dev/urandom | cudaipc put --name x -",
	}, "\n"))
	got := checkSecretRecipes("a.md")
	if len(got) != 1 || !strings.HasPrefix(got[0], "a.md:1: ") {
		t.Errorf("findings: %q, want one for line 1", got)
	}
}
