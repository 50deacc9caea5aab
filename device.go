package cudaipc

import (
	"encoding/hex"
	"errors"
	"fmt"
	"runtime"
	"strconv"
	"strings"
	"sync"

	"github.com/cudaipc/cudaipc/internal/cu"
)

// UUID identifies a GPU across processes. Ordinals differ between processes
// that see different CUDA_VISIBLE_DEVICES; UUIDs do not.
type UUID [16]byte

// String formats u as nvidia-smi does: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx.
func (u UUID) String() string {
	h := hex.EncodeToString(u[:])
	return "GPU-" + h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:32]
}

// ParseUUID parses the form String prints; the "GPU-" prefix is optional.
func ParseUUID(s string) (UUID, error) {
	var u UUID
	t := strings.TrimPrefix(s, "GPU-")
	t = strings.ReplaceAll(t, "-", "")
	if len(t) != 32 {
		return u, fmt.Errorf("cudaipc: invalid GPU UUID %q: want GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", s)
	}
	if _, err := hex.Decode(u[:], []byte(t)); err != nil {
		return u, fmt.Errorf("cudaipc: invalid GPU UUID %q: %v", s, err)
	}
	return u, nil
}

// MarshalText implements encoding.TextMarshaler.
func (u UUID) MarshalText() ([]byte, error) { return []byte(u.String()), nil }

// UnmarshalText implements encoding.TextUnmarshaler.
func (u *UUID) UnmarshalText(b []byte) error {
	v, err := ParseUUID(string(b))
	if err != nil {
		return err
	}
	*u = v
	return nil
}

// IsZero reports whether u is the zero UUID.
func (u UUID) IsZero() bool { return u == UUID{} }

// Device is a GPU as seen by this process. Devices are created once per
// process and shared; all methods are safe for concurrent use.
//
// Work on a device runs in its primary context (the one the CUDA runtime,
// PyTorch and CuPy use too), retained on first use and kept for the life of
// the process. Each call locks its goroutine to an OS thread and makes the
// context current there, so goroutines may move freely between calls.
type Device struct {
	ordinal int
	dev     cu.Device
	name    string
	uuid    UUID
	pciBus  string
	mem     uint64
	ccMajor int
	ccMinor int
	attrs   map[cu.DeviceAttribute]int

	ctxOnce sync.Once
	ctx     cu.Context
	ctxErr  error

	crcOnce sync.Once // crc32c.go
	crc     *crcKernel
	crcErr  error

	gatherOnce sync.Once // gather.go
	gather     *gatherKernel
	gatherErr  error
}

var deviceTable struct {
	once sync.Once
	list []*Device
	err  error
}

func devices() ([]*Device, error) {
	deviceTable.once.Do(func() {
		n, err := cu.DeviceGetCount()
		if err != nil {
			deviceTable.err = err
			return
		}
		for i := 0; i < n; i++ {
			d, err := newDevice(i)
			if err != nil {
				deviceTable.err = err
				return
			}
			deviceTable.list = append(deviceTable.list, d)
		}
	})
	return deviceTable.list, deviceTable.err
}

func newDevice(ordinal int) (*Device, error) {
	h, err := cu.DeviceGet(ordinal)
	if err != nil {
		return nil, err
	}
	d := &Device{ordinal: ordinal, dev: h, attrs: map[cu.DeviceAttribute]int{}}
	if d.name, err = cu.DeviceGetName(h); err != nil {
		return nil, err
	}
	u, err := cu.DeviceGetUUID(h)
	if err != nil {
		return nil, err
	}
	d.uuid = UUID(u)
	if d.pciBus, err = cu.DeviceGetPCIBusID(h); err != nil {
		return nil, err
	}
	if d.mem, err = cu.DeviceTotalMem(h); err != nil {
		return nil, err
	}
	for _, a := range []cu.DeviceAttribute{cu.AttrComputeCapabilityMajor, cu.AttrComputeCapabilityMinor,
		cu.AttrUnifiedAddressing, cu.AttrIntegrated, cu.AttrVirtualMemoryManagement,
		cu.AttrHandleTypePosixFDSupported, cu.AttrIPCEventSupported, cu.AttrMultiprocessorCount} {
		v, err := cu.DeviceGetAttribute(a, h)
		if err != nil {
			return nil, err
		}
		d.attrs[a] = v
	}
	d.ccMajor = d.attrs[cu.AttrComputeCapabilityMajor]
	d.ccMinor = d.attrs[cu.AttrComputeCapabilityMinor]
	return d, nil
}

// DeviceCount returns the number of GPUs visible to this process. Without a
// driver it returns an error matching ErrNoDriver.
func DeviceCount() (int, error) {
	l, err := devices()
	return len(l), err
}

// Devices returns every GPU visible to this process, by ordinal.
func Devices() ([]*Device, error) {
	l, err := devices()
	return append([]*Device(nil), l...), err
}

// DeviceByOrdinal returns the GPU with the given ordinal in this process.
func DeviceByOrdinal(ordinal int) (*Device, error) {
	l, err := devices()
	if err != nil {
		return nil, err
	}
	if ordinal < 0 || ordinal >= len(l) {
		return nil, &ArgError{Op: "DeviceByOrdinal", Arg: "ordinal", Reason: fmt.Sprintf("%d is out of range: this process sees %d device(s)", ordinal, len(l))}
	}
	return l[ordinal], nil
}

// ErrDeviceNotVisible is returned by DeviceByUUID for a GPU this process
// cannot see (not present, or hidden by CUDA_VISIBLE_DEVICES).
var ErrDeviceNotVisible = errors.New("cudaipc: no visible device has that UUID")

// DeviceByUUID returns the visible GPU with the given UUID.
func DeviceByUUID(u UUID) (*Device, error) {
	l, err := devices()
	if err != nil {
		return nil, err
	}
	for _, d := range l {
		if d.uuid == u {
			return d, nil
		}
	}
	return nil, fmt.Errorf("%w: %s", ErrDeviceNotVisible, u)
}

// DeviceSelector is a GPU as a person or a flag names it: an ordinal of
// this process ("0", "1", …), which CUDA_VISIBLE_DEVICES renumbers, or a
// UUID ("GPU-5f1c2a3b-…", the prefix optional), which names the same GPU in
// every process. It is the one parser of such names for the module's
// packages and commands.
type DeviceSelector struct {
	IsUUID  bool
	Ordinal int  // when !IsUUID
	UUID    UUID // when IsUUID
}

// ParseDeviceSelector parses an ordinal or a UUID. Anything else is an
// *ArgError naming both forms.
func ParseDeviceSelector(s string) (DeviceSelector, error) {
	if n, err := strconv.Atoi(s); err == nil && n >= 0 {
		return DeviceSelector{Ordinal: n}, nil
	}
	u, err := ParseUUID(s)
	if err != nil || strings.HasPrefix(s, "-") {
		return DeviceSelector{}, &ArgError{Op: "ParseDeviceSelector", Arg: "device", Reason: fmt.Sprintf("%q: want a GPU ordinal of this process (0, 1, …) or a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, as nvidia-smi -L prints it)", s)}
	}
	return DeviceSelector{IsUUID: true, UUID: u}, nil
}

// String returns the ordinal or the UUID, as ParseDeviceSelector reads it.
func (s DeviceSelector) String() string {
	if s.IsUUID {
		return s.UUID.String()
	}
	return strconv.Itoa(s.Ordinal)
}

// Device returns the GPU of this process that s names: DeviceByOrdinal or
// DeviceByUUID.
func (s DeviceSelector) Device() (*Device, error) {
	if s.IsUUID {
		return DeviceByUUID(s.UUID)
	}
	return DeviceByOrdinal(s.Ordinal)
}

// LookupDevice parses an ordinal or a UUID and returns that GPU of this
// process.
func LookupDevice(s string) (*Device, error) {
	sel, err := ParseDeviceSelector(s)
	if err != nil {
		return nil, err
	}
	return sel.Device()
}

// Ordinal returns the device's ordinal in this process.
func (d *Device) Ordinal() int { return d.ordinal }

// Name returns the product name, e.g. "NVIDIA H200".
func (d *Device) Name() string { return d.name }

// UUID returns the device's UUID.
func (d *Device) UUID() UUID { return d.uuid }

// PCIBusID returns the PCI address, e.g. "0000:18:00.0".
func (d *Device) PCIBusID() string { return d.pciBus }

// TotalMemory returns the device memory in bytes.
func (d *Device) TotalMemory() uint64 { return d.mem }

// ComputeCapability returns the SM version, e.g. (9, 0) for Hopper.
func (d *Device) ComputeCapability() (major, minor int) { return d.ccMajor, d.ccMinor }

// MultiprocessorCount returns the number of SMs.
func (d *Device) MultiprocessorCount() int { return d.attrs[cu.AttrMultiprocessorCount] }

// UnifiedAddressing reports whether the device shares one address space
// with the host and the other devices (always true on 64-bit Linux).
func (d *Device) UnifiedAddressing() bool { return d.attrs[cu.AttrUnifiedAddressing] != 0 }

// LegacyIPCSupported reports whether cuIpcGetMemHandle/cuIpcOpenMemHandle
// work on this device: they need unified addressing and are not available
// on integrated (Tegra) GPUs.
func (d *Device) LegacyIPCSupported() bool {
	return d.UnifiedAddressing() && d.attrs[cu.AttrIntegrated] == 0
}

// IPCEventSupported reports whether interprocess events are supported.
func (d *Device) IPCEventSupported() bool { return d.attrs[cu.AttrIPCEventSupported] != 0 }

// VMMFDSupported reports whether virtual-memory-management allocations can
// be exported as POSIX file descriptors (the path that works across PID
// namespaces, i.e. containers).
func (d *Device) VMMFDSupported() bool {
	return d.attrs[cu.AttrVirtualMemoryManagement] != 0 && d.attrs[cu.AttrHandleTypePosixFDSupported] != 0
}

// String returns "GPU 0 (NVIDIA H200, GPU-...)".
func (d *Device) String() string {
	return fmt.Sprintf("GPU %d (%s, %s)", d.ordinal, d.name, d.uuid)
}

func (d *Device) context() (cu.Context, error) {
	d.ctxOnce.Do(func() {
		d.ctx, d.ctxErr = cu.DevicePrimaryCtxRetain(d.dev)
	})
	return d.ctx, d.ctxErr
}

// do runs f on a locked OS thread with the device's primary context current.
func (d *Device) do(f func() error) error {
	ctx, err := d.context()
	if err != nil {
		return err
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := cu.CtxSetCurrent(ctx); err != nil {
		return err
	}
	return f()
}

// Synchronize waits for all work queued on the device by this process.
func (d *Device) Synchronize() error { return d.do(cu.CtxSynchronize) }

// MemInfo returns the device's free and total memory in bytes.
func (d *Device) MemInfo() (free, total uint64, err error) {
	err = d.do(func() error {
		var e error
		free, total, e = cu.MemGetInfo()
		return e
	})
	return free, total, err
}

// CanAccessPeer reports whether this device can map memory of peer.
func (d *Device) CanAccessPeer(peer *Device) (bool, error) {
	if peer == d {
		return true, nil
	}
	return cu.DeviceCanAccessPeer(d.dev, peer.dev)
}

// EnablePeerAccess lets work in this device's context read and write
// memory of peer directly (over NVLink or PCIe). Enabling it again is not
// an error.
func (d *Device) EnablePeerAccess(peer *Device) error {
	if peer == d {
		return nil
	}
	pctx, err := peer.context()
	if err != nil {
		return err
	}
	err = d.do(func() error { return cu.CtxEnablePeerAccess(pctx) })
	if errors.Is(err, ErrPeerAccessAlreadyEnabled) {
		return nil
	}
	return err
}
