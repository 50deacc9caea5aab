package cli

import (
	"bytes"
	"fmt"
	"io"
	"os"

	"github.com/cudaipc/cudaipc/client"
)

type putCmd struct {
	File   string `arg:"" help:"File to store, or - for standard input." placeholder:"FILE|-"`
	Name   string `required:"" help:"Name of the new object." placeholder:"NAME"`
	Device string `default:"host" help:"Where the object's memory lives: host, or a GPU ordinal or UUID (needs a GPU backend)." placeholder:"host|ORDINAL|UUID"`
	Shared bool   `help:"Let every user the daemon admits read the object (default: only your uid)."`
}

func (c *putCmd) Help() string {
	return "Copies FILE into a new object NAME and seals it, so that readers can 'cudaipc get' it. A progress bar shows on a terminal."
}

func (c *putCmd) Run(g *Globals) error {
	src, size, err := openInput(c.File, g)
	if err != nil {
		return err
	}
	defer src.Close()

	cl, err := g.dial()
	if err != nil {
		return err
	}
	defer cl.Close()

	ctx := g.Context()
	obj, err := cl.Create(ctx, c.Name, size, client.CreateOptions{Device: c.Device, Shared: c.Shared})
	if err != nil {
		return explain(err, g.socketPath())
	}
	if err := fill(obj.Bytes(), src, g, c.Name); err != nil {
		_ = obj.Abort(ctx)
		return fmt.Errorf("reading %s: %w (nothing was stored)", c.File, err)
	}
	if err := obj.Seal(ctx); err != nil {
		return explain(err, g.socketPath())
	}
	fmt.Fprintf(g.stdout, "stored %q: %s (%d bytes) on %s\n", c.Name, humanBytes(size), size, c.Device)
	return nil
}

// openInput opens FILE or standard input and returns its size. A pipe is
// read into memory first, since an object's size is fixed at creation.
func openInput(name string, g *Globals) (io.ReadCloser, int64, error) {
	f, ok := g.stdin.(*os.File)
	if name == "-" && !ok {
		data, err := io.ReadAll(g.stdin)
		return io.NopCloser(bytes.NewReader(data)), int64(len(data)), err
	}
	if name != "-" {
		var err error
		if f, err = os.Open(name); err != nil {
			return nil, 0, err
		}
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, 0, err
	}
	if st.Mode().IsRegular() {
		if name == "-" {
			return io.NopCloser(f), st.Size(), nil // never close our stdin
		}
		return f, st.Size(), nil
	}
	if st.IsDir() {
		f.Close()
		return nil, 0, fmt.Errorf("%s is a directory: put stores one file", name)
	}
	data, err := io.ReadAll(f)
	if name != "-" {
		f.Close()
	}
	if err != nil {
		return nil, 0, err
	}
	return io.NopCloser(bytes.NewReader(data)), int64(len(data)), nil
}

// fill reads exactly len(dst) bytes from src into dst, showing progress on
// a terminal.
func fill(dst []byte, src io.Reader, g *Globals, name string) error {
	bar := newProgress(g.stderr, int64(len(dst)), "put "+name)
	defer progressDone(bar)
	for off := 0; off < len(dst); {
		end := min(off+copyChunk, len(dst))
		n, err := io.ReadFull(src, dst[off:end])
		progressAdd(bar, n)
		if err == io.ErrUnexpectedEOF || err == io.EOF {
			return fmt.Errorf("input shrank while reading: got %d of %d bytes", off+n, len(dst))
		}
		if err != nil {
			return err
		}
		off = end
	}
	return nil
}
