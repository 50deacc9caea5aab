package kv

import (
	"context"
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/client"
)

// Memory is one region of a space in this process: host memory (Host) or
// GPU memory (Device, Ptr, Size). Only host memory from AllocHost can be
// registered, since readers map its memfd; any host memory can be a read's
// destination.
type Memory struct {
	Host   []byte
	File   *os.File // the memfd Host maps (AllocHost), for Register
	Device *cudaipc.Device
	Ptr    cudaipc.DevicePtr
	Size   int64
}

func (m Memory) size() int64 {
	if m.Device == nil {
		return int64(len(m.Host))
	}
	return m.Size
}

func (m Memory) device() string {
	if m.Device == nil {
		return "host"
	}
	return m.Device.UUID().String()
}

// HostMemory is host memory in a memfd, mapped read-write in this process,
// that other processes can map: what a host KV space registers. Close
// unmaps it; readers that mapped it keep it until they unmap.
type HostMemory struct {
	f    *os.File
	data []byte
}

// AllocHost allocates size bytes of zeroed host memory in a sealable memfd.
func AllocHost(size int64) (*HostMemory, error) {
	if size <= 0 {
		return nil, fmt.Errorf("kv: host memory of %d bytes: want > 0", size)
	}
	fd, err := unix.MemfdCreate("cudaipc-kv", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, fmt.Errorf("kv: memfd_create: %w", err)
	}
	f := os.NewFile(uintptr(fd), "cudaipc-kv")
	if err := f.Truncate(size); err != nil {
		f.Close()
		return nil, fmt.Errorf("kv: sizing host memory: %w", err)
	}
	b, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("kv: mapping host memory: %w", err)
	}
	return &HostMemory{f: f, data: b}, nil
}

// Bytes returns the memory; it must not be used after Close.
func (h *HostMemory) Bytes() []byte { return h.data }

// Memory returns h as a region of a space.
func (h *HostMemory) Memory() Memory { return Memory{Host: h.data, File: h.f} }

// Close unmaps the memory and closes its memfd. It is idempotent.
func (h *HostMemory) Close() error {
	if h.data == nil {
		return nil
	}
	err := unix.Munmap(h.data)
	h.data = nil
	return errors.Join(err, h.f.Close())
}

// Local is a space in this process: its layout over its memory, region by
// region. It is a read's destination, and what Register registers.
type Local struct {
	Layout
	Memory []Memory
	// space is the registration of this memory (Register), which a read
	// from another node writes through.
	space *Space
}

// check validates the layout against the memory.
func (l *Local) check() error {
	for i, m := range l.Memory {
		if m.Device != nil && m.Host != nil || m.Device == nil && m.Ptr != 0 {
			return descErr("memory", "region %d is host memory or GPU memory, not both", i)
		}
		if m.size() <= 0 {
			return descErr("memory", "region %d is empty", i)
		}
	}
	return l.Layout.check(func(i int) (int64, bool) {
		if i < 0 || i >= len(l.Memory) {
			return 0, false
		}
		return l.Memory[i].size(), true
	})
}

// Space is a registered KV space: its regions are registered memory of
// the client that registered it, Desc() describes it to readers. Its
// regions stay readable until Close or the client's connection ends (then,
// like registered VMM memory, while a reader holds a lease of them).
type Space struct {
	c     *client.Client
	desc  Desc
	local *Local
	names []string
}

// Register registers local's memory as the space name (region i as the
// object name/i, each carrying the space's description) through c. opts
// apply to every region (Shared: readable by every uid the daemon admits).
// local stays bound to the space until Close: a read from another node
// into local is written by c's daemon, through this registration.
func Register(ctx context.Context, c *client.Client, name string, local *Local, opts client.RegisterOptions) (*Space, error) {
	if err := local.check(); err != nil {
		return nil, err
	}
	d := Desc{Name: qualified(c, name), ID: NewID(), Node: c.Server().Node, Layout: local.Layout}
	for _, m := range local.Memory {
		d.Regions = append(d.Regions, Region{Device: m.device(), Size: m.size()})
	}
	b, err := d.MarshalBinary()
	if err != nil {
		return nil, err
	}
	opts.Space = b
	s := &Space{c: c, desc: d, local: local}
	for i, m := range local.Memory {
		rname := name + "/" + fmt.Sprint(i)
		if err := register(ctx, c, rname, m, opts); err != nil {
			return nil, errors.Join(err, s.Close(ctx))
		}
		s.names = append(s.names, rname)
	}
	local.space = s
	return s, nil
}

func register(ctx context.Context, c *client.Client, name string, m Memory, opts client.RegisterOptions) error {
	if m.Device == nil {
		if m.File == nil {
			return descErr("memory", "host memory to register comes from AllocHost (a memfd readers can map)")
		}
		_, err := c.RegisterHost(ctx, name, m.File, m.size(), opts)
		return err
	}
	r, files, err := cudaipc.ExportPointer(m.Device, m.Ptr, m.Size)
	if err != nil {
		return err
	}
	defer func() {
		for _, f := range files {
			f.Close()
		}
	}()
	_, err = c.Register(ctx, name, r, files, opts)
	return err
}

// qualified returns name as every uid addresses it (UID:NAME).
func qualified(c *client.Client, name string) string {
	return fmt.Sprintf("%d:%s", c.Server().PeerUID, name)
}

// Desc describes the space to readers.
func (s *Space) Desc() *Desc { return &s.desc }

// Local returns the space's memory in this process.
func (s *Space) Local() *Local { return s.local }

// Close removes the space's regions from the daemon (readers holding
// leases keep what they mapped until they release). It is idempotent.
func (s *Space) Close(ctx context.Context) error {
	var errs []error
	for _, n := range s.names {
		if err := s.c.Delete(ctx, n); err != nil && !errors.Is(err, client.ErrNotFound) {
			errs = append(errs, err)
		}
	}
	s.names = nil
	if s.local.space == s {
		s.local.space = nil
	}
	return errors.Join(errs...)
}
