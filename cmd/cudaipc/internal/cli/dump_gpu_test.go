package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// dumpExportMsg is what roleDumpExporter sends: the whole allocation and a
// sub-buffer at an odd offset.
type dumpExportMsg struct {
	Region, Sub cudaipc.Region
	Err         string
}

// dumpSubRange is the sub-buffer roleDumpExporter exports: an odd offset
// past the first 64 MiB chunk.
func dumpSubRange(size int64) (off, n int64) { return 64<<20 + 4099, size - (64<<20 + 4099) - 333 }

// roleDumpExporter allocates SIZE bytes on the GPU with UUID DEVICE, fills
// them from SEED, sends their regions and holds them until stdin closes.
func roleDumpExporter(p *testutil.Peer) error {
	fail := func(err error) error { return p.Send(dumpExportMsg{Err: err.Error()}) }
	u, err := cudaipc.ParseUUID(os.Getenv("DEVICE"))
	if err != nil {
		return fail(err)
	}
	dev, err := cudaipc.DeviceByUUID(u)
	if err != nil {
		return fail(err)
	}
	size, _ := strconv.ParseInt(os.Getenv("SIZE"), 10, 64)
	seed, _ := strconv.ParseUint(os.Getenv("SEED"), 10, 64)
	buf, err := dev.Alloc(size)
	if err != nil {
		return fail(err)
	}
	defer buf.Free()
	if _, err := buf.WriteAt(testutil.RandomBytes(seed, int(size)), 0); err != nil {
		return fail(err)
	}
	var m dumpExportMsg
	if m.Region, err = buf.Export(0, size); err != nil {
		return fail(err)
	}
	off, n := dumpSubRange(size)
	if m.Sub, err = buf.Export(off, n); err != nil {
		return fail(err)
	}
	if err := p.Send(m); err != nil {
		return err
	}
	var v any
	for p.Recv(&v) == nil {
	}
	return nil
}

// TestDumpRegionOfOtherProcess runs `cudaipc dump` in-process on regions
// exported by a helper process: JSON on the command line to a file, binary
// from @FILE to stdout, and a sub-buffer at an odd offset.
func TestDumpRegionOfOtherProcess(t *testing.T) {
	dev := testutil.RequireGPU(t)
	seed := uint64(time.Now().UnixNano())
	const size = 100<<20 + 12345 // more than one 64 MiB chunk
	c := testutil.Spawn(t, "dumpExporter", "SIZE="+strconv.FormatInt(size, 10), "SEED="+strconv.FormatUint(seed, 10), "DEVICE="+dev.UUID().String())
	var msg dumpExportMsg
	if err := c.Recv(&msg); err != nil || msg.Err != "" {
		t.Fatalf("exporter: %v %s\n%s", err, msg.Err, c.Stderr())
	}
	want := testutil.RandomBytes(seed, size)
	dir := t.TempDir()

	text, _ := json.Marshal(msg.Region)
	out := filepath.Join(dir, "whole.bin")
	var stdout, stderr bytes.Buffer
	if err := Run(context.Background(), []string{"dump", "--region", string(text), "-o", out, "--sha256"}, &stdout, &stderr); err != nil {
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

	sub := msg.Sub
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
	if err := Run(context.Background(), []string{"dump", "--region", "@" + regionFile, "--chunk", "1000"}, &stdout, &stderr); err != nil {
		t.Fatalf("dump to stdout: %v\n%s", err, stderr.String())
	}
	if !bytes.Equal(stdout.Bytes(), want[sub.Offset:sub.Offset+sub.Size]) {
		t.Fatal("sub-buffer dump differs")
	}
}
