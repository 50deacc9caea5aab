// Command doccheck checks what CI can check of the project's prose: that
// comments in non-test Go code cite no commit hashes, issue numbers or run
// dates (git blame has the history, docs/lab the runs), and that every
// reference to a document resolves: relative Markdown links and their
// anchors, docs/… paths, and citations of a section such as
// docs/cluster.md, "Security", from the
// Markdown, Go, Python and shell files git tracks.
//
//	go run ./internal/doccheck        # from the repository root; exit 1 on any finding
package main

import (
	"bytes"
	"fmt"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
)

func main() {
	files, err := trackedFiles()
	if err != nil {
		fmt.Fprintln(os.Stderr, "doccheck:", err)
		os.Exit(2)
	}
	var bad []string
	for _, f := range files {
		bad = append(bad, checkFile(f)...)
	}
	sort.Strings(bad)
	for _, b := range bad {
		fmt.Println(b)
	}
	if len(bad) > 0 {
		fmt.Printf("doccheck: %d findings. Go comments say what and why without run figures, hashes or issue numbers; references to docs must resolve (docs/lab/ keeps dated runs).\n", len(bad))
		os.Exit(1)
	}
}

// trackedFiles lists the files git tracks under the current directory.
func trackedFiles() ([]string, error) {
	out, err := exec.Command("git", "ls-files", "-z").Output()
	if err != nil {
		return nil, fmt.Errorf("git ls-files: %w", err)
	}
	var fs []string
	for _, f := range strings.Split(string(out), "\x00") {
		if f != "" {
			fs = append(fs, f)
		}
	}
	return fs, nil
}

func checkFile(f string) []string {
	switch {
	case strings.HasSuffix(f, ".go"):
		return checkGo(f)
	case strings.HasSuffix(f, ".md"):
		return append(checkRefs(f, false), checkSecretRecipes(f)...)
	case strings.HasSuffix(f, ".py"), strings.HasSuffix(f, ".sh"):
		return checkRefs(f, true)
	}
	return nil
}

var (
	// A commit hash: 7 to 40 hex digits with a digit and a letter, not part
	// of a longer word, a 0x number or a UUID.
	hexWord  = regexp.MustCompile(`[0-9a-f]{7,40}`)
	issueRef = regexp.MustCompile(`(?i)\b(issue|issues|pull request|PR)\s*#?\d+`)
	runDate  = regexp.MustCompile(`\b20\d\d-[01]\d-[0-3]\d\b`)
)

func checkGo(f string) []string {
	src, err := os.ReadFile(f)
	if err != nil {
		return []string{fmt.Sprintf("%s: %v", f, err)}
	}
	fset := token.NewFileSet()
	af, err := parser.ParseFile(fset, f, src, parser.ParseComments)
	if err != nil {
		return []string{fmt.Sprintf("%s: %v", f, err)}
	}
	generated := bytes.Contains(src, []byte("Code generated")) && bytes.Contains(src, []byte("DO NOT EDIT"))
	test := strings.HasSuffix(f, "_test.go")
	var bad []string
	for _, cg := range af.Comments {
		text := cg.Text()
		at := fset.Position(cg.Pos()).Line
		if !test && !generated {
			for _, line := range strings.Split(text, "\n") {
				if h := commitHash(line); h != "" {
					bad = append(bad, fmt.Sprintf("%s:%d: comment cites a commit (%s)", f, at, h))
				}
				if m := issueRef.FindString(line); m != "" {
					bad = append(bad, fmt.Sprintf("%s:%d: comment cites an issue (%s)", f, at, m))
				}
				if m := runDate.FindString(line); m != "" {
					bad = append(bad, fmt.Sprintf("%s:%d: comment cites a run date (%s)", f, at, m))
				}
			}
		}
		for _, b := range docRefs(f, text, true) {
			bad = append(bad, fmt.Sprintf("%s:%d: %s", f, at, b))
		}
	}
	return bad
}

// secretWrite is a shell line that writes random bytes to a secret's file.
var secretWrite = regexp.MustCompile(`/dev/urandom.*>\s*\S*secret`)

// checkSecretRecipes finds recipes in Markdown that write a secret from
// /dev/urandom without a umask that keeps it unreadable from the start (a
// chmod after the write leaves a window) or without making its directory.
func checkSecretRecipes(f string) []string {
	src, err := os.ReadFile(f)
	if err != nil {
		return []string{fmt.Sprintf("%s: %v", f, err)}
	}
	var bad []string
	for i, line := range strings.Split(string(src), "\n") {
		if !secretWrite.MatchString(line) {
			continue
		}
		if !strings.Contains(line, "umask 077") || !strings.Contains(line, "mkdir -p") {
			bad = append(bad, fmt.Sprintf("%s:%d: a secret is written readable, or into a directory that may not exist: write it as (umask 077; mkdir -p DIR && head -c 32 /dev/urandom | base64 > DIR/FILE)", f, i+1))
		}
	}
	return bad
}

// commitHash returns the first word of s that reads as a commit hash.
func commitHash(s string) string {
	for _, ix := range hexWord.FindAllStringIndex(s, -1) {
		w := s[ix[0]:ix[1]]
		if !strings.ContainsAny(w, "0123456789") || !strings.ContainsAny(w, "abcdef") {
			continue
		}
		before, after := byte(' '), byte(' ')
		if ix[0] > 0 {
			before = s[ix[0]-1]
		}
		if ix[1] < len(s) {
			after = s[ix[1]]
		}
		if isWord(before) || isWord(after) || before == '-' || after == '-' || before == 'x' {
			continue
		}
		return w
	}
	return ""
}

func isWord(c byte) bool {
	return c == '_' || c >= '0' && c <= '9' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z'
}

func checkRefs(f string, code bool) []string {
	src, err := os.ReadFile(f)
	if err != nil {
		return []string{fmt.Sprintf("%s: %v", f, err)}
	}
	var bad []string
	for _, b := range docRefs(f, string(src), code) {
		bad = append(bad, f+": "+b)
	}
	return bad
}

var (
	mdLink     = regexp.MustCompile(`\]\(([^)\s]+)\)`)
	docPath    = regexp.MustCompile(`(?:^|[\s("'\x60\[])((?:docs/)[\w./-]*\w\.(?:md|svg|json|png))`)
	sectionRef = regexp.MustCompile(`((?:docs/)?[\w./-]+\.md),?\s+\(?"([^"]{2,80})"`)
	joinLines  = regexp.MustCompile(`\s*\n\s*(?:(?://|#)\s*)?`)
)

// docRefs checks the document references in text, found in file f: links
// (Markdown files only), docs/ paths and quoted section names. code says the
// text is code or its comments, where a line break may split a reference.
func docRefs(f, text string, code bool) []string {
	var bad []string
	lab := strings.HasPrefix(f, "docs/lab/")
	if !code {
		for _, m := range mdLink.FindAllStringSubmatch(text, -1) {
			target := m[1]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			file, anchor, _ := strings.Cut(target, "#")
			p := f
			if file != "" {
				p = path.Join(path.Dir(f), file)
				if _, err := os.Stat(p); err != nil {
					bad = append(bad, fmt.Sprintf("link to %s: no such file", target))
					continue
				}
			}
			if anchor != "" && strings.HasSuffix(p, ".md") && !hasAnchor(p, anchor) {
				bad = append(bad, fmt.Sprintf("link to %s: %s has no such heading", target, p))
			}
		}
	}
	flat := joinLines.ReplaceAllString(text, " ")
	for _, m := range docPath.FindAllStringSubmatch(flat, -1) {
		if _, err := os.Stat(filepath.FromSlash(m[1])); err != nil {
			bad = append(bad, fmt.Sprintf("names %s: no such file", m[1]))
		}
	}
	if lab {
		return bad // the lab notebook quotes sections as they were named then
	}
	for _, m := range sectionRef.FindAllStringSubmatch(flat, -1) {
		doc := m[1]
		if !strings.HasPrefix(doc, "docs/") && doc != "README.md" {
			doc = path.Join(path.Dir(f), doc)
		}
		if _, err := os.Stat(doc); err != nil {
			continue // not a document of this repository; the path check reports docs/ ones
		}
		if !hasSection(doc, m[2]) {
			bad = append(bad, fmt.Sprintf("cites %s, %q: no heading or bold label of that name there", m[1], m[2]))
		}
	}
	return bad
}

var (
	heading   = regexp.MustCompile(`(?m)^#{1,6}\s+(.+?)\s*$`)
	boldLabel = regexp.MustCompile(`\*\*([^*]{2,100})\*\*`)
	slugDrop  = regexp.MustCompile(`[^\p{L}\p{N} _-]`)
)

func sections(doc string) []string {
	b, err := os.ReadFile(doc)
	if err != nil {
		return nil
	}
	var out []string
	for _, m := range heading.FindAllStringSubmatch(string(b), -1) {
		out = append(out, m[1])
	}
	for _, m := range boldLabel.FindAllStringSubmatch(string(b), -1) {
		out = append(out, m[1])
	}
	return out
}

func normal(s string) string {
	s = strings.ToLower(strings.Join(strings.Fields(strings.ReplaceAll(s, "`", "")), " "))
	return strings.TrimRight(s, ".:")
}

// hasSection says whether doc has a heading or bold label that is, or
// begins with, name.
func hasSection(doc, name string) bool {
	n := normal(name)
	for _, s := range sections(doc) {
		if strings.HasPrefix(normal(s), n) {
			return true
		}
	}
	return false
}

// hasAnchor says whether doc has a heading whose GitHub anchor is anchor.
func hasAnchor(doc, anchor string) bool {
	b, err := os.ReadFile(doc)
	if err != nil {
		return false
	}
	for _, m := range heading.FindAllStringSubmatch(string(b), -1) {
		slug := strings.ReplaceAll(slugDrop.ReplaceAllString(strings.ToLower(m[1]), ""), " ", "-")
		if slug == anchor {
			return true
		}
	}
	return false
}
