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
	"strconv"
	"strings"
	"time"

	"github.com/schollz/progressbar/v3"

	"github.com/cudaipc/cudaipc"
)

// DumpCmd writes the bytes of a region, exported by any program, to a file.
type DumpCmd struct {
	Region string `required:"" help:"The region as JSON (docs/region.md), or @FILE to read it (JSON or binary) from FILE." placeholder:"JSON|@FILE"`
	Output string `short:"o" default:"-" help:"File to write; - writes to stdout (not to a terminal)." placeholder:"FILE"`
	Device string `help:"GPU to map through when the region's GPU is not visible here (CUDA_VISIBLE_DEVICES): UUID or ordinal. Default: GPU 0." placeholder:"GPU"`
	SHA256 bool   `name:"sha256" help:"Print the SHA-256 of the bytes written to stderr."`
	Chunk  int64  `default:"67108864" help:"Bytes copied through pinned host memory at a time." placeholder:"BYTES"`
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
	var d *cudaipc.Device
	var err error
	if n, perr := strconv.Atoi(c.Device); perr == nil {
		d, err = cudaipc.DeviceByOrdinal(n)
	} else {
		u, uerr := cudaipc.ParseUUID(c.Device)
		if uerr != nil {
			return nil, fmt.Errorf("--device: %w", uerr)
		}
		d, err = cudaipc.DeviceByUUID(u)
	}
	if err != nil {
		return nil, fmt.Errorf("--device: %w", err)
	}
	return []cudaipc.ImportOption{cudaipc.WithFallbackDevice(d)}, nil
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

	m, err := cudaipc.Import(r, opts...)
	if err != nil {
		return importHint(err)
	}
	defer m.Close()
	g.log.Debug("imported", "region", r.String(), "device", m.Device().String(), "local", m.Local())

	chunk := min(c.Chunk, m.Size())
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
		bar = progressbar.NewOptions64(m.Size(),
			progressbar.OptionSetWriter(g.stderr), progressbar.OptionSetDescription("dump"),
			progressbar.OptionShowBytes(true), progressbar.OptionThrottle(100*time.Millisecond),
			progressbar.OptionClearOnFinish())
	}
	buf := host.Bytes()
	for off := int64(0); off < m.Size(); {
		if err := g.Context().Err(); err != nil {
			return err
		}
		n := min(chunk, m.Size()-off)
		if _, err := m.ReadAt(buf[:n], off); err != nil {
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
		fmt.Fprintf(g.stderr, "sha256 %s  %d bytes\n", hex.EncodeToString(sum.Sum(nil)), m.Size())
	}
	return nil
}
