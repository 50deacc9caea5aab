package cudaipc_test

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/internal/cli"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// TestDumpRegionOfOtherProcess runs `cudaipc dump` in-process on regions
// exported by a helper process: JSON on the command line to a file, binary
// from @FILE to stdout, and a sub-buffer at an odd offset.
func TestDumpRegionOfOtherProcess(t *testing.T) {
	dev := testutil.RequireGPU(t)
	seed := uint64(time.Now().UnixNano())
	const size = 100<<20 + 12345 // more than one 64 MiB chunk
	_, msg := startRegionExporter(t, dev, size, seed)
	want := testutil.RandomBytes(seed, size)
	dir := t.TempDir()

	text, _ := json.Marshal(msg.Region)
	out := filepath.Join(dir, "whole.bin")
	var stdout, stderr bytes.Buffer
	if err := cli.Run(context.Background(), []string{"dump", "--region", string(text), "-o", out, "--sha256"}, &stdout, &stderr); err != nil {
		t.Fatalf("dump: %v\n%s", err, stderr.String())
	}
	got, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("dumped %d bytes that differ from the exporter's", len(got))
	}
	if !strings.Contains(stderr.String(), "sha256 "+testutil.Sum(want)) {
		t.Fatalf("--sha256 printed %q", stderr.String())
	}

	sub := msg.Subs[0]
	bin, err := sub.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	regionFile := filepath.Join(dir, "sub.region")
	if err := os.WriteFile(regionFile, bin, 0o600); err != nil {
		t.Fatal(err)
	}
	stdout.Reset()
	stderr.Reset()
	if err := cli.Run(context.Background(), []string{"dump", "--region", "@" + regionFile, "--chunk", "1000"}, &stdout, &stderr); err != nil {
		t.Fatalf("dump to stdout: %v\n%s", err, stderr.String())
	}
	if !bytes.Equal(stdout.Bytes(), want[sub.Offset:sub.Offset+sub.Size]) {
		t.Fatal("sub-buffer dump differs")
	}
}
