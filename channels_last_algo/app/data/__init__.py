"""The NHWC data path: uint8 HWC images -> one NHWC uint8 batch -> device -> normalise in NHWC.

A usual ImageNet loader turns every image into a float32 CHW tensor on the CPU (``ToTensor``,
``Normalize``), stacks them NCHW, copies four bytes per pixel to the device, and leaves the first
convolution to transpose the batch to NHWC. Here each image is decoded only as far as its crop needs
and cropped, as ``uint8`` NHWC, straight into its slot of one channels-last ``uint8`` batch, which is
normalised on the device in one pass. One module per step, in the order an image takes them:

- :mod:`~channels_last_algo.app.data.decode`: file bytes to pixels, scaled to what the crop keeps;
- :mod:`~channels_last_algo.app.data.transforms`: the training and evaluation crops;
- :mod:`~channels_last_algo.app.data.batch`: the batch buffer the crops write into;
- :mod:`~channels_last_algo.app.data.image_folder`, :mod:`~channels_last_algo.app.data.synthetic`: the
  data sets (a checked image folder, the embedded synthetic ImageNet), and
  :mod:`~channels_last_algo.app.data.imagenet`: either one by split name;
- :mod:`~channels_last_algo.app.data.loaders`: collate, the loaders and the normalisation.

Example:
    >>> from channels_last_algo.app.data.imagenet import imagenet_dataset
    >>> from channels_last_algo.app.data.loaders import NormalizeBatch, build_loader
    >>> data = imagenet_dataset('train', crop_size=32, synthetic_samples=16, num_classes=4)
    >>> images, labels = NormalizeBatch()(next(iter(build_loader(data, batch_size=8, train=True))))
    >>> images.shape
    torch.Size([8, 3, 32, 32])
"""
