package cli

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/schollz/progressbar/v3"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/client"
)

// DumpCmd writes the bytes of a region, exported by any program, to a file.
// A vmm-fd region (an object of a daemon started with --gpu-share fd) is
// useless without its allocation's descriptor: dump asks the store daemon
// (--socket) for a lease on the object that holds it, which brings the
// descriptor, as for any admitted client.
type DumpCmd struct {
	Region string `required:"" help:"The region as JSON (docs/region.md), or @FILE to read it (JSON or binary) from FILE. A vmm-fd region (cudaipc stat --json of a daemon with --gpu-share fd) is read through that daemon (--socket)." placeholder:"JSON|@FILE"`
	Output string `short:"o" default:"-" help:"File to write; - (the default) writes to stdout (not to a terminal)." placeholder:"FILE"`
	Device string `help:"GPU to map through when the region's GPU is not visible here (CUDA_VISIBLE_DEVICES): UUID or ordinal. Default: GPU 0." placeholder:"GPU"`
	SHA256 bool   `name:"sha256" help:"Print the SHA-256 of the bytes written to stderr."`
	Chunk  int64  `default:"67108864" help:"Bytes copied through pinned host memory at a time (default ${default}: 64 MiB)." placeholder:"BYTES"`
}

// regionFileLimit bounds what --region @FILE reads: a region is 164 bytes
// binary and well under 1 KiB as JSON.
const regionFileLimit = 1 << 20

func (c *DumpCmd) readRegion() (cudaipc.Region, error) {
	text := []byte(c.Region)
	if path, ok := strings.CutPrefix(c.Region, "@"); ok {
		f, err := os.Open(path)
		if err != nil {
			return cudaipc.Region{}, fmt.Errorf("--region: %w", err)
		}
		defer f.Close()
		if text, err = io.ReadAll(io.LimitReader(f, regionFileLimit)); err != nil {
			return cudaipc.Region{}, fmt.Errorf("--region: %w", err)
		}
	}
	if !bytes.HasPrefix(text, []byte("CIPR")) {
		text = bytes.TrimSpace(text)
	}
	r, err := cudaipc.DecodeRegion(text)
	if err != nil {
		return r, fmt.Errorf("--region: %w: see docs/region.md for the format", err)
	}
	return r, nil
}

func (c *DumpCmd) options() ([]cudaipc.ImportOption, error) {
	if c.Device == "" {
		return nil, nil
	}
	d, err := cudaipc.LookupDevice(c.Device)
	if err != nil {
		return nil, fmt.Errorf("--device: %w", err)
	}
	return []cudaipc.ImportOption{cudaipc.WithFallbackDevice(d)}, nil
}

// open maps region r: with Import for a cuda-ipc region, and for a vmm-fd
// one through the store daemon, leasing the object that holds r. It returns
// the mapping, r's offset in it, and what ends the access.
func (c *DumpCmd) open(g *Globals, r cudaipc.Region, opts []cudaipc.ImportOption) (*cudaipc.Mapping, int64, func() error, error) {
	if r.Kind != cudaipc.KindVMMFD {
		m, err := cudaipc.Import(r, opts...)
		if err != nil {
			return nil, 0, nil, importHint(err)
		}
		return m, 0, m.Close, nil
	}
	cl, err := g.dial()
	if err != nil {
		return nil, 0, nil, fmt.Errorf("a vmm-fd region is read through the store daemon that holds it: %w", err)
	}
	l, err := leaseRegion(g, cl, r)
	if err != nil {
		cl.Close()
		return nil, 0, nil, err
	}
	m := l.Mapping()
	return m, r.Offset - m.Region().Offset, func() error { return errors.Join(l.Release(), cl.Close()) }, nil
}

// leaseRegion leases the object of the daemon that holds vmm-fd region r.
func leaseRegion(g *Globals, cl *client.Client, r cudaipc.Region) (*client.Lease, error) {
	holds := func(o *cudaipc.Region) bool {
		return o != nil && o.Kind == cudaipc.KindVMMFD && o.AllocationID == r.AllocationID &&
			o.Offset <= r.Offset && r.Offset+r.Size <= o.Offset+o.Size
	}
	objs, err := cl.List(g.Context())
	if err != nil {
		return nil, explain(err, g.socketPath())
	}
	for _, o := range objs {
		if !holds(o.Region) {
			continue
		}
		l, err := cl.Get(g.Context(), o.Name)
		if err != nil {
			return nil, explain(err, g.socketPath())
		}
		if m := l.Mapping(); m != nil {
			if mr := m.Region(); holds(&mr) {
				return l, nil
			}
		}
		_ = l.Release() // the name holds another object now
	}
	return nil, fmt.Errorf("dump: no object you may read in the store daemon at %s holds this vmm-fd region: point --socket at the daemon that exported it, and check that the object still exists with 'cudaipc ls'", g.socketPath())
}

// importHint tells the user, on the same line, what an Import error means
// for them.
func importHint(err error) error {
	switch {
	case errors.Is(err, cudaipc.ErrInvalidResourceHandle):
		return fmt.Errorf("importing the region: %w: the exporting process freed the memory or exited; export it again while it is alive", err)
	case errors.Is(err, cudaipc.ErrInvalidValue):
		return fmt.Errorf("importing the region: %w: the driver rejected the handle; check that the exporter still runs and that the region was exported on this machine", err)
	}
	return fmt.Errorf("importing the region: %w", err)
}

// Run implements the command.
func (c *DumpCmd) Run(g *Globals) error {
	if c.Chunk <= 0 {
		return &ExitError{Code: 2, Err: fmt.Errorf("--chunk %d: must be positive", c.Chunk)}
	}
	r, err := c.readRegion()
	if err != nil {
		return &ExitError{Code: 2, Err: err}
	}
	opts, err := c.options()
	if err != nil {
		return &ExitError{Code: 2, Err: err}
	}
	var w io.Writer = g.stdout
	var file *os.File
	if c.Output == "-" {
		if isTerminal(g.stdout) {
			return &ExitError{Code: 2, Err: errors.New("refusing to write binary data to a terminal: use -o FILE or redirect stdout")}
		}
	} else {
		// Write beside the target and rename at the end, so that a failed
		// dump leaves no truncated file under the name.
		file, err = os.CreateTemp(filepath.Dir(c.Output), "."+filepath.Base(c.Output)+".partial-*")
		if err != nil {
			return err
		}
		defer func() {
			if file != nil {
				file.Close()
				os.Remove(file.Name())
			}
		}()
		w = file
	}

	m, mOff, done, err := c.open(g, r, opts)
	if err != nil {
		return err
	}
	defer done()
	g.log.Debug("imported", "region", r.String(), "device", m.Device().String(), "local", m.Local())

	chunk := min(c.Chunk, r.Size)
	host, err := m.Device().AllocHost(chunk)
	if err != nil {
		return fmt.Errorf("allocating %d bytes of pinned host memory: %w", chunk, err)
	}
	defer host.Free()

	var sum hash.Hash
	if c.SHA256 {
		sum = sha256.New()
		w = io.MultiWriter(w, sum)
	}
	var bar *progressbar.ProgressBar
	if isTerminal(g.stderr) {
		bar = progressbar.NewOptions64(r.Size,
			progressbar.OptionSetWriter(g.stderr), progressbar.OptionSetDescription("dump"),
			progressbar.OptionShowBytes(true), progressbar.OptionThrottle(100*time.Millisecond),
			progressbar.OptionClearOnFinish())
	}
	buf := host.Bytes()
	for off := int64(0); off < r.Size; {
		if err := g.Context().Err(); err != nil {
			return err
		}
		n := min(chunk, r.Size-off)
		if _, err := m.ReadAt(buf[:n], mOff+off); err != nil {
			return fmt.Errorf("reading the region at offset %d: %w", off, err)
		}
		if _, err := w.Write(buf[:n]); err != nil {
			return err
		}
		off += n
		if bar != nil {
			_ = bar.Add64(n)
		}
	}
	if bar != nil {
		_ = bar.Finish()
	}
	if file != nil {
		if err := file.Close(); err != nil {
			return err
		}
		if err := os.Rename(file.Name(), c.Output); err != nil {
			return err
		}
		file = nil
	}
	if sum != nil {
		fmt.Fprintf(g.stderr, "sha256 %s  %d bytes\n", hex.EncodeToString(sum.Sum(nil)), r.Size)
	}
	return nil
}
